"""The OpenAI-compatible server on the default model, driven by the official ``openai`` client:
completions and chat, streamed and not, n, stop strings, logprobs, seeds, usage, /tokenize,
/metrics, and 64 concurrent streams against the same prompts sent one at a time."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from live_server import LiveServer

MODEL = "smol"
PROMPTS = [f"Write one sentence about the number {i}." if i % 2 else f"List {i} colors:" for i in range(64)]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer("--served-model-name", MODEL, "other-name", "--max-model-len", "1024",
                   log=tmp_path_factory.mktemp("server") / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """(text per choice index, finish reason per index, usage) of a completions stream."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            text = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + text
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_streamed_equals_whole(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=20, **GREEDY)
    choice = whole.choices[0]
    assert choice.text.strip() and choice.finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == 5 and whole.usage.completion_tokens <= 20
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=20, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    texts, reasons, usage = stream_text(chunks)
    assert texts == {0: choice.text} and reasons == {0: choice.finish_reason}
    assert usage == whole.usage.model_dump()


def test_every_prompt_form(client, server):
    text = "The capital of France is"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, **GREEDY).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY).choices[0].text
    assert by_ids == by_text
    many = client.completions.create(model=MODEL, prompt=[text, "One, two,"], max_tokens=8, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == by_text
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=8, **GREEDY)
    assert many_ids.choices[0].text == by_text
    assert many_ids.usage.prompt_tokens == len(ids) + 3


def test_chat_streamed_equals_whole_and_counts_the_template(client, server):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, **GREEDY)
    message = whole.choices[0].message
    assert message.role == "assistant" and "Rome" in message.content
    count = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert whole.usage.prompt_tokens == count
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons, usage = stream_text(chunks)
    assert texts == {0: message.content} and reasons == {0: whole.choices[0].finish_reason}
    assert usage == whole.usage.model_dump()


def test_n_and_seed(client):
    def sample(seed, stream=False):
        out = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=16, seed=seed,
                                        temperature=1.0, stream=stream)
        if stream:
            return stream_text(out)[0]
        assert 2 <= out.usage.completion_tokens <= 32
        return {c.index: c.text for c in out.choices}

    first = sample(1234)
    assert sorted(first) == [0, 1] and first[0] != first[1]
    assert sample(1234) == first
    assert sample(1234, stream=True) == first
    assert sample(99) != first
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a joke"}],
                                           n=2, max_tokens=12, seed=7).choices for _ in range(2)]
    assert [c.message.content for c in chat[0]] == [c.message.content for c in chat[1]]


def test_sampling_defaults_come_from_the_models_generation_config(client):
    """--generation-config auto: the default model's folder recommends temperature 0.2 and top_p
    0.9 (its model card's), and a request that sets neither samples with them."""
    def chat(**fields):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three rivers."}],
                                             max_tokens=24, seed=11, **fields)
        return out.choices[0].message.content

    plain = chat()
    assert plain == chat(temperature=0.2, top_p=0.9)
    assert plain != chat(temperature=1.0, top_p=1.0)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, stream):
    prompt = "Count: 1, 2, 3, 4,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], stream=stream, **GREEDY)
    if stream:
        texts, reasons, _ = stream_text(out)
        text, reason = texts[0], reasons[0]
    else:
        text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert out.choices[0].model_extra["stop_reason"] == stop
    assert text == full[:full.index(stop)] and reason == "stop"


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, logprobs=3,
                                    echo=True, **GREEDY)
    choice, usage = out.choices[0], out.usage
    lp = choice.logprobs
    assert choice.text.startswith("The capital of France is")
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens[usage.prompt_tokens:], lp.token_logprobs[usage.prompt_tokens:],
                                   lp.top_logprobs[usage.prompt_tokens:]):
        assert 1 <= len(top) <= 4 and logprob <= 0
        assert logprob == pytest.approx(max(top.values())) and top[token] == logprob  # greedy = the top token
    for logprob in lp.token_logprobs[1:usage.prompt_tokens]:
        assert logprob <= 0


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello"}],
                                         max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)
        assert bytes(c.bytes).decode() == c.token


def test_tokenize_detokenize_round_trip(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello, world!", "model": MODEL}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello, world!"


def test_metrics_count_one_request(server, client):
    before = server.wait_idle()
    out = client.completions.create(model=MODEL, prompt="Tell me about the sea.", max_tokens=10, **GREEDY)
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("octavo:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("octavo:generation_tokens_total") == out.usage.completion_tokens
    assert delta("octavo:time_to_first_token_seconds_count") == 1
    assert delta("octavo:e2e_request_latency_seconds_count") == 1
    assert delta("octavo:inter_token_latency_seconds_count") == out.usage.completion_tokens - 1
    assert delta("octavo:request_success_total") == 1
    assert delta("octavo:prefix_cache_queries_total") == out.usage.prompt_tokens
    assert after["octavo:kv_cache_usage_perc"] == 0 and after["octavo:num_preemptions_total"] >= 0


def test_64_concurrent_streams_equal_one_at_a_time(server, client):
    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100))) as a:
            return await asyncio.gather(*(one(a, p) for p in PROMPTS))

    concurrent = asyncio.run(all_at_once())
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, **GREEDY).choices[0].text
             for p in PROMPTS]
    assert concurrent == alone
    assert len(set(alone)) > 32  # the prompts really differ
    assert server.wait_idle()["octavo:kv_cache_used_blocks"] == 0
