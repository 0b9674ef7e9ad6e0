"""vLLM's completion-server tests (tests/v1/entrypoints/openai/test_completion.py) whose behaviour
Octavo covers, re-written against ``octavo serve`` on the default model: the same requests and
the same assertions, with the default model's tokens where vLLM's name OPT-125m's, and prompts it
does not answer with EOS at once where a test needs whole-length outputs."""

from __future__ import annotations

import openai
import pytest

from live_server import LiveServer

MODEL = "smol"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer("--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "128",
                   "--no-enable-prefix-caching", log=tmp_path_factory.mktemp("vllm-ports") / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


def test_single_completion(client):
    completion = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    assert completion.id is not None and len(completion.choices) == 1
    choice = completion.choices[0]
    assert len(choice.text) >= 5 and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert len(completion.choices[0].text) >= 1
    assert completion.choices[0].prompt_logprobs is None


@pytest.mark.parametrize("logprobs,low,high", [(None, None, None), (0, 1, 1), (5, 5, 6)])
def test_no_zero_and_some_logprobs(client, logprobs, low, high):
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                           logprobs=logprobs)
    choice = completion.choices[0]
    if logprobs is None:
        assert choice.logprobs is None
        return
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.top_logprobs is not None
    assert low <= len(choice.logprobs.top_logprobs[0]) <= high


def test_too_many_completion_logprobs(client):
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                           logprobs=30, stream=True):
            pass
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert len(completion.choices[0].text) >= 0  # the server still works


def test_completion_streaming(client):
    prompt = "Once upon a time, an LLM"
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, stream=True))
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1  # only the last block
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == single


def test_parallel_no_streaming(client):
    n = 3
    completion = client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=50, n=n,
                                           temperature=1.0, stream=False, logprobs=0, seed=42)
    assert len(completion.choices) == n
    for index, choice in enumerate(completion.choices):
        assert choice.index == index and choice.finish_reason is not None
    assert len({choice.text for choice in completion.choices}) == n  # n unique completions


def test_parallel_streaming(client):
    """The samples' tokens come flattened into one stream, each chunk naming its sample."""
    n = 3
    stream = client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=50, n=n, temperature=1.0,
                                       stream=True, seed=42)
    texts, finished = [""] * n, [0] * n
    for chunk in stream:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        finished[choice.index] += choice.finish_reason is not None
    assert finished == [1] * n and len(set(texts)) == n
    whole = client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=50, n=n, temperature=1.0,
                                      seed=42)
    assert [c.text for c in whole.choices] == texts


def test_completion_stream_options(client):
    prompt = "The capital of France is a city where"
    common = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0)
    for chunk in client.completions.create(**common, stream=True, stream_options={"include_usage": False}):
        assert chunk.usage is None
    stream = client.completions.create(**common, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert chunk.choices == [] and chunk.usage.completion_tokens == 5
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**common, stream=False, stream_options=options)


def test_batch_completions(client):
    prompts = ["Hello, my name is"] * 2
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0)
    assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] == batch.choices[0].text


def test_echo_logprob_completion(client):
    prompt = "Hello, my name is"
    for logprobs in (None, 0, 3):
        completion = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=5,
                                               logprobs=logprobs, temperature=0.0)
        choice = completion.choices[0]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        if logprobs is None:
            assert choice.logprobs is None
            continue
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None  # the first prompt token has none
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 5
        assert all(top is None or logprobs <= len(top) <= logprobs + 1 for top in lp.top_logprobs)
