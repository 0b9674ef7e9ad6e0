"""The server under bad input, disconnects, overload, timeouts, shutdown and a mixed load: every
fault gets an OpenAI-style error, the server stays healthy, and no KV block stays in use."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time

import httpx
import pytest

from live_server import LiveServer

KEY = "test-key"
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer("--max-model-len", "256", "--served-model-name", "smol",
                   log=tmp_path_factory.mktemp("faults") / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """One running request at a time, one waiting, a 4 s request timeout and an API key."""
    s = LiveServer("--api-key", KEY, "--max-num-seqs", "1", "--max-waiting-requests", "1", "--request-timeout", "4",
                   log=tmp_path_factory.mktemp("guarded") / "serve.log")
    yield s
    s.stop_cleanly(signal.SIGTERM)


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", '{"prompt": "hi", ', 400),
    ("not an object", "/v1/completions", "[1, 2]", 400),
    ("max_tokens of the wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("prompt of the wrong type", "/v1/completions", {"prompt": 5}, 400),
    ("no prompt", "/v1/completions", {"max_tokens": 5}, 400),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("zero max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),
    ("top_p of 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("top_p above 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("n of 0", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("greedy n > 1", "/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400),
    ("max_tokens beyond max_model_len", "/v1/completions", {"prompt": "hi", "max_tokens": 300}, 400),
    ("prompt beyond max_model_len", "/v1/completions", {"prompt": "word " * 300, "max_tokens": 1}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999999]}, 400),
    ("too many logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400),
    ("logit_bias outside the vocabulary", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 10}}, 400),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "hi", "logit_bias": {"five": 10}}, 400),
    ("empty allowed_token_ids", "/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400),
    ("allowed_token_ids outside the vocabulary", "/v1/completions",
     {"prompt": "hi", "allowed_token_ids": [99999999]}, 400),
    ("empty bad word", "/v1/completions", {"prompt": "hi", "bad_words": [""]}, 400),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404),
    ("messages of the wrong type", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("message without a role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("chat beyond max_model_len", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}, 400),
    ("unknown chat model", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "x"},
     404),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [-1]}, 400),
    ("unknown route", "/v1/embeddings", {"input": "hi"}, 404),
    # Each of these once gave a 500, and most left every later request failing.
    ("chat seed of 2**63", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**63},
     400),
    ("seed of 2**64", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "seed": 2**64}, 400),
    ("seed below -2**63", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "seed": -2**63 - 1}, 400),
    ("seed of 1e30", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "seed": 1e30}, 400),
    ("stop token id beyond int32", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [2**31]},
     400),
    ("stop token id outside the vocabulary", "/v1/completions",
     {"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [49152]}, 400),
    ("negative stop token id", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [-1]}, 400),
    ("chat min_tokens beyond int32 without max_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2**31}, 400),
    ("lone surrogate in the prompt", "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 8}', 400),
    ("lone surrogate in a message", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a\\udc00b"}], "max_tokens": 8}', 400),
    ("JSON nested 100000 deep", "/v1/completions", '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", 400),
    ("unknown field nested 5000 deep", "/v1/completions",
     '{"prompt": "hi", "extra": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}", 400),
    ("max_tokens of 5000 digits", "/v1/completions", '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", 400),
    ("n beyond --max-n", "/v1/completions", {"prompt": "hi", "n": 1000}, 400),
    ("chat n beyond --max-n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129},
     400),
    ("top_logprobs beyond --max-logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400),
    ("best_of", "/v1/completions", {"prompt": "hi", "n": 1, "best_of": 3}, 400),
    ("top_k of 1e20 (not an int64, as pydantic reads it)", "/v1/completions",
     {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "top_k": 1e20}, 400),
]

# Values at the edge of their type that vLLM accepts: each must give a normal answer.
EXTREME_BUT_VALID = [
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 0, "repetition_penalty": 1e-300},
    {"temperature": 1.0, "repetition_penalty": 1e300},
    {"temperature": 1.0, "top_k": 2**31},
    {"temperature": 1e300},
    {"temperature": 1.0, "seed": 2**63 - 1, "n": 2},
    {"temperature": 1.0, "seed": -2**63},
    {"temperature": 1.0, "min_p": 1.0},
    {"temperature": 0, "presence_penalty": -2, "frequency_penalty": 2},
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error(server, name, path, body, status):
    content = body if isinstance(body, str) else json.dumps(body)
    for stream in (False, True):
        if stream and (not isinstance(body, dict) or "stream_options" in body):
            continue
        sent = content if not stream else json.dumps({**body, "stream": True})
        r = httpx.post(f"{server.url}{path}", content=sent, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["code"] == status and error["type"]


@pytest.mark.parametrize("fields", EXTREME_BUT_VALID, ids=[json.dumps(f) for f in EXTREME_BUT_VALID])
def test_values_at_their_limits_get_an_answer(server, fields):
    body = {"prompt": "Hello", "max_tokens": 8, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] in ("length", "stop") for c in r.json()["choices"])
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_server_is_healthy_after_bad_input(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.wait_idle()["octavo:kv_cache_used_blocks"] == 0


def test_disconnects_abort_and_free_the_blocks(server):
    aborted_before = server.metrics().get("octavo:request_success_total:abort", 0)
    clients = [httpx.Client(timeout=30) for _ in range(6)]
    for i, client in enumerate(clients):  # streams: leave after a few tokens
        with client.stream("POST", f"{server.url}/v1/completions",
                           json={"prompt": f"Story {i}:", "stream": True, "max_tokens": 200, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)]
        client.close()
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming request whose client gives up
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "Story:", "max_tokens": 200, "ignore_eos": True},
                   timeout=0.5)
    after = server.wait_idle()
    assert after["octavo:kv_cache_used_blocks"] == 0 and after["octavo:num_requests_running"] == 0
    assert after["octavo:request_success_total:abort"] - aborted_before == 7


def test_500_mixed_requests_leave_no_blocks_in_use(server):
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        kind = i % 7
        tokens = rng.randint(1, 8)
        if kind == 0:
            r = await client.post("/v1/completions", json={"prompt": f"Item {i}", "max_tokens": tokens})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= tokens
        elif kind == 1:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Hi {i}"}], "n": 2, "max_tokens": tokens, "seed": i})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        elif kind == 2:
            r = await client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
            assert r.status_code == 400
        elif kind in (3, 4):
            path, body = (("/v1/completions", {"prompt": [f"A {i}", f"B {i}"]}) if kind == 3 else
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Q{i}"}]}))
            async with client.stream("POST", path, json={**body, "stream": True, "max_tokens": tokens}) as r:
                lines = [line async for line in r.aiter_lines() if line]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        elif kind == 5:  # leaves mid-stream
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": f"Long {i}", "stream": True, "max_tokens": 100, "ignore_eos": True}) as r:
                async for _ in r.aiter_lines():
                    break
        else:
            r = await client.post("/v1/completions", json={"prompt": f"Echo {i}", "max_tokens": tokens, "echo": True,
                                                           "logprobs": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(f"Echo {i}")

    async def run_all() -> None:
        limit = asyncio.Semaphore(48)

        async def bounded(client, i):
            async with limit:
                await one(client, i)

        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(*(bounded(client, i) for i in range(500)))

    asyncio.run(run_all())
    after = server.wait_idle()
    assert after["octavo:kv_cache_used_blocks"] == 0 and after["octavo:num_requests_waiting"] == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_api_key(guarded):
    good = {"Authorization": f"Bearer {KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{guarded.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = httpx.post(f"{guarded.url}/v1/completions", headers=headers, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
    assert httpx.get(f"{guarded.url}/v1/models", headers=good).status_code == 200
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):  # they run user input
        assert httpx.post(f"{guarded.url}{path}", json=body).status_code == 401
        assert httpx.post(f"{guarded.url}{path}", json=body, headers=good).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200


SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}ok"


def test_a_slow_user_template_stalls_nobody(server):
    """A request's own chat template runs in a worker with a time limit; meanwhile the server
    answers /health and finishes other requests."""
    result = {}

    def render():
        result["r"] = httpx.post(f"{server.url}/tokenize", json={
            "messages": [{"role": "user", "content": "hi"}], "chat_template": SLOW_TEMPLATE}, timeout=60)

    thread = threading.Thread(target=render)
    thread.start()
    time.sleep(1.0)
    assert httpx.get(f"{server.url}/health", timeout=3).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=10)
    assert r.status_code == 200
    assert thread.is_alive(), "the template finished before the server was probed"
    thread.join(60)
    assert result["r"].status_code == 400
    assert "did not finish within" in result["r"].json()["error"]["message"]
    # The worker was replaced: the next request's template renders.
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "chat_template": "{{ messages[0]['content'] }}!"})
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_templates_and_prompts_too_large_for_the_model_are_refused_early(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "chat_template": "{{ 'ab ' * 3000000 }}"},
                   timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "word " * 2_000_000, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * (17 << 20)}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_requests_arriving_mid_step_are_not_counted_as_waiting(tmp_path):
    """With room for 256 running requests, 64 at once all start: none of them waits, so a
    waiting limit of 4 refuses none."""
    s = LiveServer("--max-waiting-requests", "4", "--max-model-len", "256", log=tmp_path / "serve.log")
    try:
        async def run_all():
            async with httpx.AsyncClient(base_url=s.url, timeout=120,
                                         limits=httpx.Limits(max_connections=64)) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": f"Item {i}", "max_tokens": 16, "ignore_eos": True}) for i in range(64)))

        statuses = [r.status_code for r in asyncio.run(run_all())]
        assert statuses == [200] * 64
    finally:
        s.stop_cleanly()


def _stream_in_background(url: str, body: dict, lines: list[str]) -> threading.Thread:
    def read():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                lines.extend(line for line in r.iter_lines() if line)
        except httpx.TransportError:  # the server closed the connection (shutdown)
            lines.append("closed")

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def _wait_for(server: LiveServer, name: str, value: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics()[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_overload_gets_503_and_timeouts_abort(guarded):
    running, waiting = [], []
    first = _stream_in_background(guarded.url, {"prompt": "One", **LONG}, running)
    _wait_for(guarded, "octavo:num_requests_running", 1)
    second = _stream_in_background(guarded.url, {"prompt": "Two", **LONG}, waiting)
    _wait_for(guarded, "octavo:num_requests_waiting", 1)
    r = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Three", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == 503
    first.join(30), second.join(30)
    for lines in (running, waiting):  # both hit the 4 s timeout: an error event, then [DONE]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 504
    assert len(running) > len(waiting)
    r = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Four", **LONG}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 504 and r.json()["error"]["code"] == 504
    assert guarded.wait_idle()["octavo:kv_cache_used_blocks"] == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_shutdown_finishes_short_requests_and_aborts_long_ones(tmp_path, sig):
    s = LiveServer("--shutdown-timeout", "3", log=tmp_path / "serve.log")
    short, long = [], []
    threads = [_stream_in_background(s.url, {"prompt": "Long", **LONG}, long),
               _stream_in_background(s.url, {"prompt": "Short", "max_tokens": 8}, short)]
    _wait_for(s, "octavo:num_requests_running", 2)
    started = time.monotonic()
    s.stop_cleanly(sig)
    assert time.monotonic() - started < 20
    for thread in threads:
        thread.join(10)
    assert short[-1] == "data: [DONE]" and len(short) >= 3  # finished within the grace period
    assert long[-1] == "closed" or "error" in long[-2]  # cut off: an error event or a closed connection
