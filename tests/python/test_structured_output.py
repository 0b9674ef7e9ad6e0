"""Structured output end to end: StructuredOutputsParams' checks, each backend's validation
(xgrammar's messages, the fallback to llguidance), and LLM.generate on a tiny random Llama with a
real byte-level BPE tokenizer, where random weights make the grammar the only reason an output
follows it: every kind of constraint, greedy and sampled, beside unconstrained requests that it
must not touch, through an engine core in its own process too, and with the failures a request
must keep to itself (a grammar the core cannot compile, an abort while compiling)."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel  # noqa: E402

from octavo import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from octavo import structured_output  # noqa: E402
from octavo.structured_output.backend_xgrammar import MAX_JSON_WHITESPACE, choice_grammar  # noqa: E402

SO = StructuredOutputsParams


# ---- the parameters and their validation -------------------------------------------------------

def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="must use one kind"):
        SO()
    with pytest.raises(ValueError, match="only use one kind .* multiple are specified: \\['json', 'regex'\\]"):
        SO(json={"type": "string"}, regex="a+")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        SO(choice="yes")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        SO(choice=[])
    with pytest.raises(ValueError, match="regex must be a string"):
        SO(regex=5)
    with pytest.raises(ValueError, match="json must be a JSON schema"):
        SO(json=3.5)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert SO(json_object=True).kind == "json_object"
    assert SO(json_object=False, regex="x").kind == "regex"


def test_a_pydantic_model_is_its_json_schema():
    class Car(BaseModel):
        brand: str
        seats: int

    assert SO(json=Car).json == Car.model_json_schema()


@pytest.mark.parametrize("params, message", [
    (SO(json="{not json"), "Invalid JSON grammar specification."),
    (SO(json={"type": "object", "properties": 5}), "Failed to transform json schema into a grammar: properties must"),
    (SO(regex="[a-"), "Failed to transform regex into a grammar: Regex parsing error at position 4: Unclosed '\\['"),
    (SO(regex="(?=a)a"), "Lookahead is not supported"),  # neither backend takes it: xgrammar's message
    (SO(grammar="root ::= foo"), "Invalid grammar specification: .*Rule \"foo\" is not defined"),
    (SO(structural_tag="{}"), "Invalid structural tag specification"),
    (SO(structural_tag="[1, 2"), "Invalid structural tag specification: not JSON text"),
])
def test_invalid_constraints_raise_the_backends_message(params, message):
    with pytest.raises(ValueError, match=message) as caught:
        structured_output.validate(params)
    assert not re.match(r"\[[\d:]+\]", str(caught.value)), "xgrammar's log prefix is noise to a user"


@pytest.mark.parametrize("params", [SO(regex=r"\p{L}+"), SO(grammar='start: "a"+ "b"')])
def test_auto_falls_back_to_llguidance_where_xgrammar_refuses(params):
    structured_output.validate(params)
    assert params._backend == "guidance"
    with pytest.raises(ValueError):
        structured_output.validate(params, "xgrammar")
    params.disable_fallback = True
    with pytest.raises(ValueError):
        structured_output.validate(params)


def test_xgrammar_is_the_default_backend():
    for params in (SO(json={"type": "integer"}), SO(regex="a+"), SO(choice=["x"]), SO(grammar='root ::= "a"'),
                   SO(json_object=True)):
        structured_output.validate(params)
        assert params._backend == "xgrammar"
    with pytest.raises(ValueError, match="backend must be one of"):
        structured_output.validate(SO(regex="a"), "outlines")


@pytest.mark.parametrize("choices", [["a", "b"], ['say "hi"', "back\\slash", "tab\there", "new\nline"],
                                     ["é", "日本", "😀"], ["", "x"]])
def test_choice_grammar_accepts_exactly_the_choices(choices):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_ebnf(choice_grammar(choices))
    for c in choices:
        assert _is_grammar_accept_string(grammar, c)
        assert not _is_grammar_accept_string(grammar, c + "z")


def test_structural_tag_in_both_forms():
    legacy = {"type": "structural_tag", "triggers": ["<fn="],
              "structures": [{"begin": "<fn=add>", "schema": {"type": "object"}, "end": "</fn>"}]}
    structured_output.validate(SO(structural_tag=json.dumps(legacy)))
    current = {"type": "structural_tag", "format": {"type": "const_string", "value": "done"}}
    structured_output.validate(SO(structural_tag=json.dumps(current)))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["regex", "grammar", "json", "structural_tag"]), text=st.text(max_size=40))
def test_any_text_is_compiled_or_refused_with_a_value_error(kind, text):
    """Whatever a client sends as a regex, grammar, schema or tag: a backend takes it, or it is a
    ValueError (a 400), never another exception or a crash."""
    try:
        structured_output.validate(SO(**{kind: text}))
    except ValueError:
        return
    assert SO(**{kind: text}).kind == kind


@settings(max_examples=100, deadline=None)
@given(choices=st.lists(st.text(max_size=12), min_size=1, max_size=5))
def test_any_choice_list_compiles(choices):
    structured_output.validate(SO(choice=choices))


@pytest.mark.parametrize("constraint", [SO(regex="[a-c]{2}-[0-9]{3}"), SO(grammar='start: "ab-" ("1" | "2")+ "3"')])
def test_grammar_states_roll_back(tiny_path, constraint):
    """What speculative decoding needs: tokens taken back leave the grammar where it was."""
    import numpy as np
    from octavo.loader import load_tokenizer
    from octavo.structured_output import StructuredOutputManager

    tokenizer = load_tokenizer(tiny_path)
    manager = StructuredOutputManager(str(tiny_path), len(tokenizer))
    try:
        manager.add(1, manager.compile(constraint).result())
        tokens = tokenizer.encode("ab-123")
        assert manager.accept(1, tokens[:2])
        before = manager.bitmask([1])[0].copy()
        assert manager.accept(1, tokens[2:])
        assert not np.array_equal(manager.bitmask([1])[0], before)
        manager.rollback(1, len(tokens) - 2)
        assert np.array_equal(manager.bitmask([1])[0], before)
    finally:
        manager.shutdown()


# ---- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)


def generate(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["a", "b"]},
                                           "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["n", "tag", "xs"]}


def _valid_json(text: str, schema=None) -> bool:
    value = json.loads(text)
    if schema is not None:
        jsonschema.validate(value, schema)
    return True


# (constraint, what a following output satisfies). The random model pads JSON with whitespace
# as long as a grammar lets it (test_json_whitespace_is_bounded): these JSON constraints have none.
CONSTRAINTS = [
    (SO(json=SCHEMA, disable_any_whitespace=True), lambda t: _valid_json(t, SCHEMA)),
    (SO(json_object=True, disable_any_whitespace=True), lambda t: isinstance(json.loads(t), dict)),
    (SO(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
    (SO(choice=["left", "right", "up or down"]), lambda t: t in ("left", "right", "up or down")),
    (SO(grammar='root ::= "ab" ("ab" | "cd")? "!"'), lambda t: re.fullmatch(r"ab(ab|cd)?!", t)),  # EBNF: xgrammar
    (SO(grammar='start: "ab" ("ab" | "cd")? "!"'), lambda t: re.fullmatch(r"ab(ab|cd)?!", t)),  # Lark: llguidance
    (SO(regex=r"\p{Lu}{2}[0-9]"),  # a Unicode class: llguidance
     lambda t: len(t) == 3 and t[0].isupper() and t[1].isupper() and t[2].isdigit()),
]


@pytest.mark.parametrize("constraint, check", CONSTRAINTS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_their_constraint(llm, constraint, check, temperature):
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=120, structured_outputs=constraint)
    for o in generate(llm, ["Answer:", "The value is", "x"], params):
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_unconstrained_requests_are_untouched(llm):
    """A constrained request in the batch masks its own row only: the others' tokens equal a run
    without it (the CPU engine's outputs are batch-invariant)."""
    plain = SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)
    alone = generate(llm, ["one", "two"], plain)
    constrained = SamplingParams(temperature=1.0, seed=9, max_tokens=24, structured_outputs=SO(regex="[a-c]{4}"))
    mixed = generate(llm, ["one", "two", "three"], [plain, plain, constrained])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert re.fullmatch("[a-c]{4}", mixed[2].text)
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=40, structured_outputs=SO(choice=["cat", "dog"]))
    out = llm.generate("Pet:", params, use_tqdm=False)[0].outputs
    assert len(out) == 3 and all(o.text in ("cat", "dog") for o in out)


def test_json_whitespace_is_bounded(llm):
    """Runs of whitespace between JSON tokens stop at MAX_JSON_WHITESPACE characters, so a model
    cannot pad a value until max_tokens cuts it."""
    pair = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=240, structured_outputs=SO(json=pair),
                            logit_bias={t: 10.0 for t in _whitespace_tokens(llm)})
    for o in generate(llm, ["a", "b", "c", "d"], params):
        assert o.finish_reason == "stop"
        runs = [len(m) for m in re.findall(r"\s+", o.text)]
        assert runs and max(runs) <= MAX_JSON_WHITESPACE
        jsonschema.validate(json.loads(o.text), pair)


def _whitespace_tokens(llm) -> list[int]:
    tok = llm.get_tokenizer()
    return [i for i in range(len(tok)) if (s := tok.decode([i])) and not s.strip()]


def test_ignore_eos_runs_on_unconstrained_after_the_grammar_ends(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, structured_outputs=SO(choice=["ab"]))
    o = generate(llm, ["go"], params)[0]
    assert o.text.startswith("ab") and len(o.token_ids) == 10


def test_invalid_constraint_is_refused_before_it_runs(llm):
    with pytest.raises(ValueError, match="Unclosed"):
        llm.generate("x", SamplingParams(structured_outputs=SO(regex="[a-")), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_grammar_the_core_cannot_compile_fails_alone(llm, monkeypatch):
    """A constraint that reaches the core unchecked (here: validation skipped) fails its own
    request with "error" when the compile fails; the batch beside it runs on."""
    monkeypatch.setattr(structured_output, "validate", lambda params, backend="auto": None)
    bad = SamplingParams(max_tokens=8, structured_outputs=SO(regex="[a-"))
    good = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(regex="[xy]{3}"))
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = generate(llm, ["p", "q", "r"], [bad, good, plain])
    assert out[0].finish_reason == "error"
    assert re.fullmatch("[xy]{3}", out[1].text) and out[1].finish_reason == "stop"
    assert len(out[2].token_ids) == 8
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


def test_abort_while_compiling(llm):
    engine = llm.llm_engine
    engine.add_request("waiting", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=SO(json=SCHEMA)))
    engine.abort_request(["waiting"])
    assert not engine.has_unfinished_requests()
    while engine.core.engine_core.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.block_pool.num_used_blocks == 0


def test_engine_core_in_its_own_process(tiny_path):
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256,
              multiprocess=True)
    try:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=constraint)
                  for i, (constraint, _) in enumerate(CONSTRAINTS)]
        for (_, check), o in zip(CONSTRAINTS, generate(llm, ["a", "b", "c", "d", "e", "f", "g"], params)):
            assert o.finish_reason == "stop" and check(o.text), o.text
    finally:
        llm.llm_engine.shutdown()


def test_structured_outputs_config_backend(tiny_path):
    with pytest.raises(ValueError, match="backend must be one of"):
        LLM(model=str(tiny_path), structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ValueError, match="takes only 'backend'"):
        LLM(model=str(tiny_path), structured_outputs_config={"backend": "auto", "reasoning_parser": "x"})
