"""Speculative decoding (ngram drafts, verified by rejection_sample) end to end: the tokens are
those of decoding without it, greedy or seeded, alone or in batches, with logprobs, stop
strings, min_tokens, max_tokens and structured output; the sampled distribution is the
target's (chi-square); and the configuration is vLLM's.

Most tests use a "chain" model: a tiny Llama whose layers add nothing, so its next token
depends on the current token alone (a Markov chain with one likely successor per token). A
prompt that walks the chain twice gives prompt lookup drafts that are mostly right, so steps
accept several tokens.
"""

import json
import re

import numpy as np
import pytest
import torch
import transformers
from test_models import ARCHITECTURES, tiny_checkpoint

from octavo import LLM, SamplingParams
from octavo.executor.step_io import StepTimes
from octavo.speculative import PROBE_OVERHEAD, STEP_COST_ROWS, SpeculativeConfig, Speculator

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CHAIN_VOCAB = 32


def chain_checkpoint(path, vocab: int = CHAIN_VOCAB, sharpness: float = 0.6, layers: int = 1) -> list[int]:
    """Saves the chain model; returns successor[t], each token's likely next token (a permutation).
    With o_proj and down_proj zero every layer adds nothing, so the logits are lm_head(norm(embed[t])).
    lm_head's row for s points along embed[t] where s = successor[t]: a logit of sharpness *
    sqrt(hidden) for the successor against about N(0, sharpness) for the others."""
    torch.manual_seed(0)
    hidden = 128
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=256,
                                      num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
                                      eos_token_id=1)
    model = transformers.LlamaForCausalLM(config).float().eval()
    successor = torch.randperm(vocab)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        unit = embed / embed.norm(dim=1, keepdim=True)
        model.lm_head.weight[successor] = sharpness * unit
    model.save_pretrained(path)
    return successor.tolist()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain")
    successor = chain_checkpoint(path)
    plain = LLM(str(path), skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    spec = LLM(str(path), skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=32 << 20,
               speculative_config=NGRAM)
    return successor, plain, spec


def walk(successor: list[int], start: int, n: int = CHAIN_VOCAB + 8) -> list[int]:
    """The chain from ``start``; by default past the end of its cycle (at most CHAIN_VOCAB long),
    so that the model's likely continuation is already in the prompt for prompt lookup."""
    tokens = [start]
    while len(tokens) < n:
        tokens.append(successor[tokens[-1]])
    return tokens


def token_ids(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def counts(llm: LLM):
    return llm.llm_engine.stats.spec_decoding


def speculator(llm: LLM):
    return llm.llm_engine.core.engine_core.speculator


def draft_always(llm: LLM) -> LLM:
    """The engine drafting whatever its drafts cost (the cost rule off)."""
    speculator(llm).needed = lambda batch: 0.0
    return llm


@pytest.fixture
def always_drafting(chain):
    """The chain's speculative engine with drafts at any batch size."""
    draft_always(chain[2])
    yield
    del speculator(chain[2]).needed


# ---- configuration ---------------------------------------------------------------------------


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 2)
    c = SpeculativeConfig.from_dict({"model": "/models/draft", "num_speculative_tokens": 3, "quantization": "int4"})
    assert (c.method, c.num_lookahead_tokens) == ("draft_model", 3)
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize("config,match", [
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size must be an integer >= 2"),
    ({"num_speculative_tokens": 2, "method": "medusa"}, "'medusa' is not supported by Octavo yet"),
    ({"num_speculative_tokens": 2, "method": "draft_model"}, "needs the draft model's directory"),
    ({"num_speculative_tokens": 2, "model": "/m", "quantization": "fp6"}, "quantization must be one of"),
    ({"num_speculative_tokens": 2, "model": "/m", "prompt_lookup_max": 3}, "belong to the 'ngram' method"),
    ({"num_speculative_tokens": 2, "method": "ngram", "model": "/m"}, "takes no 'model'"),
    ({"num_speculative_tokens": 2, "method": "lookahead"}, "unknown speculative method 'lookahead'"),
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown or unsupported field"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_are_refused_with_vllms_messages(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_a_drafting_models_measured_time_sets_the_acceptance_that_pays():
    """Until three steps are timed a draft model's rows are priced by its weights; then by its
    measured time in target rows, c0 + c1 * n for n drafting requests (fixed costs included)."""
    spec = Speculator(SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 3}), "cpu", 1.0)
    assert spec.needed(8) == pytest.approx(2 * 8 / 24)
    for n in (1, 4, 8, 2, 6):  # a target row takes 1 ms; drafting takes 10 ms plus 1 ms per request
        spec.record_times(StepTimes(rows=4 * n, model_seconds=(16 + 4 * n) * 1e-3, drafted=n,
                                    draft_seconds=(10 + n) * 1e-3))
    assert spec.draft_time.rows(8) == pytest.approx(18)
    assert spec.needed(8) == pytest.approx((8 + 18 / 3) / 24) and spec.needed(1) == pytest.approx((1 + 11 / 3) / 17)
    spec.record_times(StepTimes(rows=5, model_seconds=0.02))  # a step that drafted nothing: the fit fades
    assert spec.draft_time.rows(8) == pytest.approx(18)
    for _ in range(40):
        spec.record_times(StepTimes(rows=5, model_seconds=0.02))
    assert spec.draft_time.rows(8) is None and spec.needed(8) == pytest.approx(2 * 8 / 24)


def test_startup_times_set_the_prices_until_the_steps_own_replace_them():
    spec = Speculator(SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 3}), "cpu", 1.0)
    spec.calibrate(20.0, [(1, 12.0), (16, 42.0)])  # drafting: 10 rows + 2 per request
    assert spec.step_cost_rows == 20.0 and spec.draft_time.rows(8) == pytest.approx(26)
    assert spec.needed(8) == pytest.approx((8 + 26 / 3) / 28)
    for _ in range(60):  # the steps find it dearer: 30 rows + 2 per request
        spec.record_times(StepTimes(rows=32, model_seconds=52e-3, drafted=8, draft_seconds=46e-3))
    assert 42 < spec.draft_time.rows(8) < 46  # the steps outweigh the startup times 6 to 1
    for _ in range(200):  # no drafting: the steps' times fade and the startup prices are left
        spec.record_times(StepTimes(rows=8, model_seconds=28e-3))
    assert spec.draft_time.rows(8) == pytest.approx(26, rel=1e-3)


@pytest.mark.parametrize("config,drafting", [({"method": "ngram", "num_speculative_tokens": 3}, []),
                                             ({"model": "/m", "num_speculative_tokens": 3}, [(1, 36.0), (16, 150.0)])])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_a_useless_drafters_probes_cost_probe_overhead(config, drafting, batch):
    """Requests whose drafts are all rejected probe again now and then; their probes (k rows and,
    with a draft model, one request's drafting) cost PROBE_OVERHEAD of their share of the steps."""
    spec = Speculator(SpeculativeConfig.from_dict(config), "cpu", 0.0 if not drafting else 1.0)
    spec.calibrate(24.0, drafting)
    k, handles, steps, probes = 3, list(range(batch)), 4000, 0
    for _ in range(steps):
        chosen = [handles[i] for i in spec.draft_rows(handles, batch)]
        probes += len(chosen)
        spec.record(chosen, np.full(len(chosen), k), np.ones(len(chosen), dtype=int))  # every draft rejected
    probe_rows = k + (spec.draft_time.rows(1) if drafting else 0)
    share = (batch + 24.0) / batch
    if spec.needed(batch) >= 1:  # the draft model in a batch of 8 or 64: drafting cannot pay
        assert probes == 0
        return
    assert probes * probe_rows / (steps * batch) / share == pytest.approx(PROBE_OVERHEAD, rel=0.35)


def test_drafting_is_timed_only_where_a_request_fits():
    from octavo.worker.step_costs import drafting_sizes

    assert drafting_sizes(256, 100, 2) == [1, 16] and drafting_sizes(4, 100, 1) == [1, 4]
    assert drafting_sizes(1, 100, 1) == [1] and drafting_sizes(256, 7, 2) == [1, 3]
    assert drafting_sizes(256, 3, 3) == []  # k drafts' blocks exceed the cache: nothing is timed


def test_an_engine_prices_its_drafter_before_the_first_request(tmp_path):
    chain_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20,
              speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})
    rule = speculator(llm)
    assert 0 < rule.step_cost_rows <= 1000 and rule.step_cost_rows != STEP_COST_ROWS["cpu"]
    assert rule.draft_time.rows(1) > 0 and rule.draft_time.rows(16) > 0  # timed before any step


def test_engines_refuse_what_speculation_cannot_serve(tiny_path):
    with pytest.raises(ValueError, match="pipeline parallelism"):
        LLM(str(tiny_path), speculative_config=NGRAM, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="custom logits processors"):
        LLM(str(tiny_path), speculative_config=NGRAM, logits_processors=["test_logits_processors:ForceToken"])


# ---- the same tokens -------------------------------------------------------------------------


def test_greedy_chain_accepts_several_tokens_per_step_and_changes_nothing(chain):
    successor, plain, spec = chain
    prompts = [walk(successor, s) for s in (2, 5, 9)] + [[3, 4, 5]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = counts(spec)
    assert token_ids(spec, prompts, params) == token_ids(plain, prompts, params)
    after = counts(spec)
    assert after.num_accepted_tokens - before.num_accepted_tokens > 60
    per_position = np.subtract(after.accepted_per_position, before.accepted_per_position)
    assert (per_position > 0).all() and (np.diff(per_position) <= 0).all()  # position j needs j - 1 accepted


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_greedy_tiny_architectures_alone_and_in_batches(kind, tmp_path):
    """Random tiny models fall into loops, which prompt lookup then drafts."""
    tiny_checkpoint(kind, tmp_path)
    args = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    plain, spec = LLM(str(tmp_path), **args), LLM(str(tmp_path), speculative_config=NGRAM, **args)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 300, size=n).tolist() for n in (5, 17, 33, 8)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = token_ids(plain, prompts, params)
    assert token_ids(spec, prompts, params) == expected
    assert token_ids(spec, prompts[1:2], params) == expected[1:2]
    assert counts(spec).num_accepted_tokens > 0


def test_seeded_sampling_draws_the_same_tokens(chain):
    """Verification draws each row with sample()'s own (seed, counter): a seeded request gets the
    tokens it gets without speculation, penalties and filters included."""
    successor, plain, spec = chain
    prompts = [walk(successor, s) for s in range(6)]
    for params in (SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.01, seed=12, max_tokens=30,
                                  ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2,
                                  presence_penalty=0.1)):
        assert token_ids(spec, prompts, params) == token_ids(plain, prompts, params)


def test_logprobs_are_the_targets(chain):
    successor, plain, spec = chain
    prompts = [walk(successor, 7)]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, logprobs=3)
    a = plain.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
    b = spec.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids
    assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
    assert [sorted(e) for e in b.logprobs] == [sorted(e) for e in a.logprobs]
    for x, y in zip(a.logprobs, b.logprobs):
        for t in x:
            assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-5) and y[t].rank == x[t].rank


def test_stop_tokens_min_tokens_and_max_tokens_stay_exact(chain):
    """A stop token among several accepted ones ends the request there; min_tokens bans stop
    tokens in the rows before it; max_tokens cuts the drafts."""
    successor, plain, spec = chain
    prompts = [walk(successor, 4)]
    path = walk(successor, successor[prompts[0][-1]], 30)  # the likely continuation
    for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[path[5]]),
                   SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[path[5]], min_tokens=9),
                   SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=30, stop_token_ids=[path[3], path[8]],
                                  min_tokens=4)):
        a = plain.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.finish_reason, b.stop_reason) == (a.token_ids, a.finish_reason, a.stop_reason)


def test_batch_of_mixed_requests_equals_each_alone(chain):
    """Greedy and seeded, drafting and not, in one batch with chunked prefill splitting prompts:
    every request gets what it gets alone without speculation."""
    successor, plain, spec = chain
    prompts = [walk(successor, s) for s in range(10)] + [list(range(2, 30))] * 2
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=20 + i, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs):
        assert list(out.outputs[0].token_ids) == token_ids(plain, [prompt], p)[0]


# ---- the distribution ------------------------------------------------------------------------


def chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of the chi-square homogeneity test of two samples of category ids (categories
    with fewer than 10 expected per sample are pooled into one)."""
    cats, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
    counts_ = np.zeros((2, len(cats)))
    np.add.at(counts_[0], inverse[:len(a)], 1)
    np.add.at(counts_[1], inverse[len(a):], 1)
    rare = counts_.sum(0) < 20
    table = np.concatenate([counts_[:, ~rare], counts_[:, rare].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_first_tokens_follow_the_target_distribution(chain, always_drafting):
    """2000 seeded samples of the first 4 tokens with speculation against 2000 others without
    (other seeds): the joint histograms agree (chi-square, p > 0.01) while most steps accept
    drafts."""
    successor, plain, spec = chain
    prompt = walk(successor, 3)
    n = 2000

    def first_four(llm, seeds):
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True) for s in seeds]
        outputs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        return np.array([int(np.ravel_multi_index(o.outputs[0].token_ids, (CHAIN_VOCAB,) * 4)) for o in outputs])

    before = counts(spec)
    with_spec = first_four(spec, range(n))
    without = first_four(plain, range(n, 2 * n))
    assert counts(spec).num_accepted_tokens - before.num_accepted_tokens > n
    assert chi_square_p(with_spec, without) > 0.01
    # The test can tell distributions apart: a target at another temperature is refused.
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    cooler = spec.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    cooler = np.array([int(np.ravel_multi_index(o.outputs[0].token_ids, (CHAIN_VOCAB,) * 4)) for o in cooler])
    assert chi_square_p(cooler, without) < 1e-6


# ---- load ------------------------------------------------------------------------------------


def test_requests_whose_drafts_fail_stop_drafting_in_a_batch(chain):
    """Prompts whose history misleads prompt lookup (each token followed by another than its
    successor): in a batch, the requests stop drafting after a few rejected drafts; alone, a
    request keeps drafting (its rows come nearly free)."""
    successor, plain, spec = chain
    liar = np.roll(successor, 1).tolist()  # a wrong successor for every token
    prompts = [walk(liar, s) for s in range(32)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def draft_tokens(batch):
        before = counts(spec).num_draft_tokens
        assert token_ids(spec, batch, params) == token_ids(plain, batch, params)
        return counts(spec).num_draft_tokens - before

    rule, measured = speculator(spec), speculator(spec).step_cost_rows
    rule.calibrate(STEP_COST_ROWS["cpu"], [])  # this tiny model's rows are all but free: price the default model's
    try:
        gated = draft_tokens(prompts)
        ungated = draft_tokens(prompts) if draft_always(spec) else None
    finally:
        rule.calibrate(measured, [])
        del rule.needed
    assert gated < ungated / 4
    assert draft_tokens(prompts[:1]) > 20


def test_disable_by_batch_size_drafts_nothing_for_a_large_batch(tmp_path):
    successor = chain_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20,
              speculative_config={**NGRAM, "disable_by_batch_size": 3})
    prompts = [walk(successor, s) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    token_ids(llm, prompts, params)
    assert counts(llm).num_draft_tokens == 0
    token_ids(llm, prompts[:2], params)
    assert counts(llm).num_draft_tokens > 0


# ---- the default model -----------------------------------------------------------------------

COPY_PROMPT = ("Repeat the text exactly.\nText: The committee approved the budget for the new library, which will "
               "open in the spring with a reading room, a cafe and a garden.\nRepeated text:")


@pytest.fixture(scope="module")
def default_models():
    args = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
    return LLM(**args), LLM(speculative_config=NGRAM, **args)


def test_default_model_greedy_alone_and_in_a_batch(default_models):
    plain, spec = default_models
    prompts = [COPY_PROMPT, "Write a haiku about the sea.", "def fibonacci(n):\n    if n < 2:\n        return n\n",
               "List three colors:"]
    params = SamplingParams(temperature=0, max_tokens=48)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    before = counts(spec)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    assert spec.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
    assert counts(spec).num_accepted_tokens - before.num_accepted_tokens > 20


def test_default_model_stop_strings_end_where_they_would(default_models):
    plain, spec = default_models
    for stop, include in (["garden"], False), (["reading room", "cafe"], True), ([" the "], False):
        params = SamplingParams(temperature=0, max_tokens=60, stop=stop, include_stop_str_in_output=include)
        a = plain.generate([COPY_PROMPT], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([COPY_PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
            (a.text, a.token_ids, a.finish_reason, a.stop_reason)


def test_default_model_structured_output(default_models):
    """Drafts stop before a token the grammar refuses, and each verified row is masked for the
    grammar after the drafts before it: the constrained outputs are those without speculation."""
    from octavo.sampling_params import StructuredOutputsParams

    plain, spec = default_models
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "words": {"type": "integer"}},
              "required": ["text", "words"]}
    prompt = COPY_PROMPT + " Answer in JSON with the repeated text and its number of words."
    regex = r"The [a-z ,]{10,80}\."
    for constraint in (StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=regex)):
        params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint)
        a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert b.token_ids == a.token_ids
        if constraint.json:
            assert set(json.loads(b.text)) == {"text", "words"}
        else:
            assert re.fullmatch(regex, b.text)


def test_server_streams_the_same_text_and_counts_acceptance(default_models, tmp_path):
    """octavo serve --speculative-config: whole and streamed replies are those of an engine
    without speculation, and /metrics counts drafts and accepted tokens (vLLM's names)."""
    pytest.importorskip("openai")
    import openai
    from live_server import LiveServer

    plain, _ = default_models
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = plain.generate([COPY_PROMPT], params, use_tqdm=False)[0].outputs[0].text
    server = LiveServer("--max-model-len", "512", "--speculative-config", json.dumps(NGRAM), log=tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=COPY_PROMPT, max_tokens=40,
                                          temperature=0)
        assert whole.choices[0].text == expected
        stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=COPY_PROMPT, max_tokens=40,
                                           temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == expected
        m = server.wait_idle()
        drafts, tokens = m["octavo:spec_decode_num_drafts_total"], m["octavo:spec_decode_num_draft_tokens_total"]
        accepted = m["octavo:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= tokens and drafts <= tokens
        assert m["octavo:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    finally:
        server.stop_cleanly()


# ---- a draft model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_drafts(chain, tmp_path_factory):
    """Engines on the chain model drafting with: itself in int8 (it agrees almost always), and
    another random model of the same vocabulary (it rarely agrees)."""
    _, plain, _ = chain
    target = str(plain.llm_engine.model_path)
    other = tmp_path_factory.mktemp("other-draft")
    tiny_checkpoint("llama", other, vocab_size=CHAIN_VOCAB)  # 256 positions
    args = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    own = draft_always(LLM(target, speculative_config={"model": target, "quantization": "int8",
                                                       "num_speculative_tokens": 3}, **args))
    stranger = draft_always(LLM(target, speculative_config={"model": str(other), "num_speculative_tokens": 2},
                                **args))  # the rule would not let it draft: its startup time says none pays
    return own, stranger


def test_a_tensor_parallel_target_prices_and_verifies_a_draft_models_drafts(chain):
    """The target's timed startup steps run on both ranks (they are collective), the draft on the
    driver alone."""
    pytest.importorskip("zmq")
    successor, plain, _ = chain
    target = str(plain.llm_engine.model_path)
    llm = draft_always(LLM(target, skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20,
                           tensor_parallel_size=2, speculative_config={"model": target, "quantization": "int8",
                                                                       "num_speculative_tokens": 3}))
    assert speculator(llm).draft_time.rows(1) > 0
    prompts = [walk(successor, s, 12) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    assert counts(llm).num_accepted_tokens > 30
    llm.llm_engine.shutdown()


def test_draft_model_changes_no_token(chain, chain_drafts):
    successor, plain, _ = chain
    prompts = [walk(successor, s, 12) for s in range(5)] + [list(range(2, 31))]
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=4, max_tokens=40, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=25, stop_token_ids=[7],
                                  min_tokens=3)):
        expected = token_ids(plain, prompts, params)
        own, stranger = chain_drafts
        before = counts(own)
        assert token_ids(own, prompts, params) == expected
        assert counts(own).num_draft_tokens > before.num_draft_tokens
        assert token_ids(stranger, prompts, params) == expected
    own_rate = counts(own).num_accepted_tokens / counts(own).num_draft_tokens
    stranger_rate = counts(stranger).num_accepted_tokens / counts(stranger).num_draft_tokens
    assert own_rate > 0.5 > stranger_rate


def test_the_target_as_its_own_draft_is_always_accepted(default_models):
    """The default model drafting for itself drafts exactly its greedy tokens, as the kernels give
    a row the same bits in any batch: every draft is accepted only if the draft's KV cache (the
    target's block ids, lookahead slots, catch-up after each step) is right. The second round
    continues the first round's requests, so it finds them in the prefix cache (whole blocks and,
    copied, their partly filled last blocks), beside a prompt that chunked prefill splits."""
    from octavo.default_model import default_model_path

    plain, _ = default_models
    llm = draft_always(LLM(max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=64,
                           speculative_config={"model": str(default_model_path()), "num_speculative_tokens": 3}))
    encode = llm.get_tokenizer().encode
    prompts = [encode(p) for p in (COPY_PROMPT, "Hi", "Write a poem about the sea and the stars.")]
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    for _ in range(2):
        expected = token_ids(plain, prompts, params)
        assert token_ids(llm, prompts, params) == expected
        prompts = [p + out + encode(" Go on.") for p, out in zip(prompts, expected)]  # the next turn
    c = counts(llm)
    assert llm.llm_engine.stats.prefix_cache_hits > 80
    assert c.num_draft_tokens > 60 and c.num_accepted_tokens == c.num_draft_tokens


def test_self_draft_survives_preemption(default_models):
    """A pool too small for the batch preempts requests; a resumed request's draft KV is
    written again from its start (its blocks went back to the pool: without the prefix cache
    they come back as other blocks), so every draft is still accepted."""
    from octavo.default_model import default_model_path

    plain, _ = default_models
    llm = draft_always(LLM(max_model_len=512, kv_cache_memory_bytes=40 * 2 * 737280, enable_prefix_caching=False,
                           speculative_config={"model": str(default_model_path()), "num_speculative_tokens": 3}))
    assert llm.llm_engine.info.num_blocks == 40
    drafter = llm.llm_engine.core.engine_core.executor.driver_worker.drafter
    catch_up, starts = drafter._catch_up, []  # (handle, tokens of its draft KV) before each catch-up

    def watched(handles, table, tokens):
        starts.extend((h, drafter.computed.get(h, 0)) for h in handles)
        return catch_up(handles, table, tokens)

    drafter._catch_up = watched
    prompts = [f"Item {i}: write a long list of fruits, one per line." for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    c = counts(llm)
    assert llm.llm_engine.stats.num_preemptions > 0
    assert c.num_draft_tokens > 50 and c.num_accepted_tokens == c.num_draft_tokens
    seen, restarted = set(), set()  # a resumed request's draft KV is written again from its start
    for handle, computed in starts:
        if computed == 0 and handle in seen:
            restarted.add(handle)
        seen.add(handle)
    assert restarted


def test_draft_model_must_share_the_vocabulary(chain, tmp_path):
    _, plain, _ = chain
    tiny_checkpoint("llama", tmp_path)  # 300 tokens against the chain's 32
    with pytest.raises(ValueError, match="must share a tokenizer"):
        LLM(str(plain.llm_engine.model_path), skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20,
            speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})


def test_default_model_with_its_int4_self_draft(default_models):
    plain, _ = default_models
    from octavo.default_model import default_model_path

    path = str(default_model_path())
    spec = draft_always(LLM(max_model_len=512, kv_cache_memory_bytes=64 << 20,
                            speculative_config={"model": path, "quantization": "int4", "num_speculative_tokens": 3}))
    prompts = [COPY_PROMPT, "Why is the sky blue?"]
    for params in (SamplingParams(temperature=0, max_tokens=32),
                   SamplingParams(temperature=0.8, seed=9, max_tokens=32)):
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    assert counts(spec).num_accepted_tokens > 10
