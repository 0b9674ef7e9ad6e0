"""Reasoning outputs: the deepseek_r1 and qwen3 parsers (whole and streamed), the engine core
starting a request's structured output after its </think> token, and `octavo serve
--reasoning-parser` on a tiny random model whose tokenizer has <think> and </think> tokens (the
default model's has not): reasoning apart from content, whole and streamed, include_reasoning,
and a constraint that holds for the answer only."""

from __future__ import annotations

import re

import pytest

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.entrypoints.openai.reasoning_parsers import ReasoningStream, make_parser

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ANSWER = r"[0-9]{2}-[a-z]{3}"


@pytest.fixture(scope="module")
def think_path(tmp_path_factory):
    from test_detokenizer import _byte_level_bpe
    from test_models import tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny-thinker")
    tokenizer = _byte_level_bpe()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    tiny_checkpoint("llama", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    return path


@pytest.fixture(scope="module")
def tokenizer(think_path):
    from octavo.loader import load_tokenizer

    return load_tokenizer(think_path)


@pytest.mark.parametrize("text, reasoning, answer", [
    ("<think>Let me see.</think>42", "Let me see.", "42"),
    ("Let me see.</think>42", "Let me see.", "42"),  # <think> was in the prompt
    ("<think>Still thinking", "Still thinking", ""),  # cut off while thinking
    ("</think>", "", ""),
])
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split_whole_and_streamed(tokenizer, name, text, reasoning, answer):
    parser = make_parser(name, tokenizer)
    assert parser.split(text, final=True) == (reasoning, answer)
    stream, thought, answers = ReasoningStream(parser), "", []
    for i in range(1, len(text) + 1):
        new, partial_answer = stream.advance(text[:i], final=i == len(text))
        thought += new
        answers.append(partial_answer)
    assert thought == reasoning and answers[-1] == answer
    assert all(answer.startswith(a) for a in answers), "the answer only grows"


def test_qwen3_without_thinking_and_missing_tokens(tokenizer):
    assert make_parser("qwen3", tokenizer).thinks({"enable_thinking": False}) is False
    assert make_parser("deepseek_r1", tokenizer).thinks({"enable_thinking": False}) is True
    from test_detokenizer import _byte_level_bpe

    with pytest.raises(ValueError, match="needs <think> and </think> as single tokens"):
        make_parser("deepseek_r1", _byte_level_bpe())


def test_reasoning_ended_in_prompt(tokenizer):
    parser = make_parser("qwen3", tokenizer)
    start, end = parser.start_id, parser.end_id
    assert not parser.ended_in_prompt([5, 6, start])
    assert parser.ended_in_prompt([5, start, end, 6])
    assert not parser.ended_in_prompt([start, end, 7, start])
    assert not parser.ended_in_prompt([5, 6])


def test_the_constraint_starts_after_the_reasoning(think_path, tokenizer):
    """The engine core masks nothing while a request thinks, then holds the answer to its
    grammar: the reasoning is free text, what follows </think> matches the regex."""
    end = make_parser("deepseek_r1", tokenizer).end_id
    llm = LLM(model=str(think_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    params = []
    for seed in range(6):
        so = StructuredOutputsParams(regex=ANSWER)
        so._reasoning_end = end
        # </think> made likely, so that the random model stops thinking within a few tokens.
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=60, logit_bias={end: 4.0},
                                     structured_outputs=so, skip_special_tokens=False))
    thoughts = 0
    for out in llm.generate(["think about it"] * 6, params, use_tqdm=False):
        o = out.outputs[0]
        reasoning, sep, answer = o.text.partition("</think>")
        assert sep and o.finish_reason == "stop", o.text
        assert re.fullmatch(ANSWER, answer), o.text
        thoughts += bool(reasoning)
    assert thoughts >= 2, "the reasoning itself must be unconstrained free text"


# ---- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(think_path, tmp_path_factory):
    pytest.importorskip("openai")
    from live_server import LiveServer

    s = LiveServer(str(think_path), "--served-model-name", "thinker", "--max-model-len", "256",
                   "--reasoning-parser", "deepseek_r1", log=tmp_path_factory.mktemp("reasoning") / "serve.log")
    yield s
    s.stop_cleanly()


def ask(server, think_id: int, **extra):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "hi"}], temperature=1.0, seed=3, max_tokens=60,
        logit_bias={str(think_id): 4.0}, extra_body={"structured_outputs": {"regex": ANSWER}, **extra.pop("body", {})},
        **extra)


def test_reasoning_apart_from_content_whole_and_streamed(server, tokenizer):
    end = make_parser("deepseek_r1", tokenizer).end_id
    message = ask(server, end).choices[0].message
    extra = message.model_extra
    assert re.fullmatch(ANSWER, message.content)
    assert extra["reasoning"] == extra["reasoning_content"] and "</think>" not in (extra["reasoning"] or "")
    chunks = list(ask(server, end, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    assert streamed_reasoning == (extra["reasoning"] or "")
    assert "".join(d.content or "" for d in deltas) == message.content
    hidden = ask(server, end, body={"include_reasoning": False}).choices[0].message
    assert "reasoning" not in hidden.model_extra and re.fullmatch(ANSWER, hidden.content)
