"""`vllm serve` options beyond the basics, as vLLM's tests use them: prompt token details (prefix
cache hits), /tokenizer_info, /load, X-Request-Id, tokens as token ids, --chat-template,
priority scheduling, and a named refusal for the options of features Octavo lacks."""

from __future__ import annotations

import threading

import pytest

from live_server import LiveServer

import httpx  # noqa: E402
import openai  # noqa: E402

from octavo.entrypoints.cli import build_parser  # noqa: E402

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
LONG_PROMPT = "The history of the river begins in the mountains, where snow melts each spring and " * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("options")
    (folder / "template.jinja").write_text(TEMPLATE)
    s = LiveServer("--max-model-len", "512", "--enable-prompt-tokens-details", "--enable-tokenizer-info-endpoint",
                   "--enable-server-load-tracking", "--enable-request-id-headers", "--return-tokens-as-token-ids",
                   "--chat-template", str(folder / "template.jinja"), "--scheduling-policy", "priority",
                   "--served-model-name", "smol", log=folder / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_cached_tokens_count_prefix_cache_hits(client):
    first = client.completions.create(model="smol", prompt=LONG_PROMPT, max_tokens=2)
    second = client.completions.create(model="smol", prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks, never the last token
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": LONG_PROMPT}],
                                            max_tokens=2, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    again = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": LONG_PROMPT}],
                                           max_tokens=2)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_tokenizer_info(server):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] and info["chat_template"] == TEMPLATE


def test_load_counts_requests_in_flight(server):
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    started = threading.Event()

    def long_stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(30)
    assert httpx.get(f"{server.url}/load").json()["server_load"] == 1
    thread.join(60)
    assert httpx.get(f"{server.url}/load").json()["server_load"] == 0


def test_request_id_header_is_echoed_or_made(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["X-Request-Id"] == "abc-123"
    made = httpx.get(f"{server.url}/v1/models").headers["X-Request-Id"]
    assert len(made) == 32 and made != httpx.get(f"{server.url}/v1/models").headers["X-Request-Id"]


def test_tokens_as_token_ids(client):
    out = client.completions.create(model="smol", prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == 3 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)
    assert all(k.startswith("token_id:") for top in out.choices[0].logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, temperature=0)
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
    text = client.completions.create(model="smol", prompt="Hello", max_tokens=3, logprobs=0, temperature=0,
                                     extra_body={"return_tokens_as_token_ids": False})
    assert "".join(text.choices[0].logprobs.tokens) == text.choices[0].text


def test_chat_template_option_replaces_the_models(server):
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "<<user>> Hi\n<<assistant>>"


def test_priority_field(client, server):
    out = client.completions.create(model="smol", prompt="Hello", max_tokens=2, extra_body={"priority": -5})
    assert out.usage.completion_tokens == 2
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "priority": 2**31})
    assert r.status_code == 400 and "32-bit" in r.json()["error"]["message"]


@pytest.mark.parametrize("argv,feature", [(["--enable-lora"], "LoRA adapters"),
                                          (["--enable-sleep-mode"], "sleep mode"),
                                          (["--kv-transfer-config", "{}"], "KV cache transfer (disaggregated prefill)")])
def test_options_of_missing_features_are_refused_by_name(argv, feature, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2
    assert f"{feature} is not supported by Octavo yet" in capsys.readouterr().err


def test_expert_parallel_is_an_option_now():
    assert build_parser().parse_args(["serve", "--enable-expert-parallel"]).enable_expert_parallel is True
    assert build_parser().parse_args(["serve"]).enable_expert_parallel is False
