"""vLLM's extra request fields and outputs on the OpenAI server, driven by the ``openai`` client
as vLLM's own tests drive it: prompt_logprobs, top_logprobs -1, return_token_ids,
truncate_prompt_tokens, continuous usage stats, chat echo, /tokenize token_strs, one choice per
streamed chunk, and vLLM's messages for empty and out-of-vocabulary prompts."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from live_server import LiveServer

MODEL = "smol"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer("--served-model-name", MODEL, "--max-model-len", "512",
                   log=tmp_path_factory.mktemp("fields") / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from octavo.default_model import default_model_path
    from octavo.loader import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("num", [0, 1, 5])
def test_completion_prompt_logprobs(client, tokenizer, num):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": num})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer.encode(prompt)
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry  # the prompt's own token, with its rank, plus the top `num`
        assert num <= len(entry) <= num + 1
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_of_two_prompts(client, prompt_logprobs):
    """vLLM's test_prompt_logprobs_completion, as it is written there."""
    params = {"prompt": ["A robot may not injure another robot", "My name is"], "model": MODEL}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**params)
        return
    completion = client.completions.create(**params)
    if prompt_logprobs is not None:
        assert completion.choices[0].prompt_logprobs is not None and len(completion.choices[0].prompt_logprobs) > 0
        assert completion.choices[1].prompt_logprobs is not None and len(completion.choices[1].prompt_logprobs) > 0
    else:
        assert completion.choices[0].prompt_logprobs is None


def test_chat_prompt_logprobs_and_their_limits(client, server):
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                         extra_body={"prompt_logprobs": 1})
    entries = out.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 2 for e in entries[1:])
    for extra, message in (({"prompt_logprobs": -1}, "must be a positive value"),
                           ({"prompt_logprobs": 21}, "limit of 20"),
                           ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)


def test_chat_top_logprobs_minus_one_is_the_vocabulary_and_bounded(client):
    with pytest.raises(openai.BadRequestError, match="limit of 20"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids(client, tokenizer, stream):
    prompt = "Once upon a time"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, stream=stream, **GREEDY,
                                    extra_body={"return_token_ids": True})
    chunks = list(out) if stream else [out]
    prompt_ids = [c.choices[0].model_extra["prompt_token_ids"] for c in chunks]
    token_ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    text = "".join(c.choices[0].text for c in chunks)
    assert prompt_ids[0] == tokenizer.encode(prompt) and all(p is None for p in prompt_ids[1:])
    assert len(token_ids) == 5 and tokenizer.decode(token_ids) == text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          stream=stream, **GREEDY, extra_body={"return_token_ids": True})
    chunks = list(chat) if stream else [chat]
    assert chunks[0].model_extra["prompt_token_ids"]
    choice_ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    content = "".join((ch.delta.content or "") if stream else ch.message.content for c in chunks for ch in c.choices)
    assert len(choice_ids) == 4 and tokenizer.decode(choice_ids) == content


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens(client, tokenizer, side):
    prompt = " ".join(f"w{i}" for i in range(60))
    ids = tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY,
                                    extra_body={"truncate_prompt_tokens": 10, "truncation_side": side,
                                                "return_token_ids": True})
    assert out.usage.prompt_tokens == 10
    assert out.choices[0].model_extra["prompt_token_ids"] == (ids[-10:] if side == "left" else ids[:10])
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 513})


def test_continuous_usage_stats(client):
    stream = client.completions.create(model=MODEL, prompt="Count to ten:", max_tokens=6, stream=True, **GREEDY,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(chunks) >= 6
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)


def test_streamed_choices_come_one_per_chunk(client):
    stream = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=4, temperature=1.0, seed=3,
                                       stream=True)
    chunks = list(stream)
    assert all(len(c.choices) == 1 for c in chunks)
    assert {c.choices[0].index for c in chunks} == {0, 1, 2}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, temperature=1.0, seed=3, stream=True)
    assert all(len(c.choices) == 1 for c in chat)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_continues_the_assistants_message(client, stream):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=stream, **GREEDY,
                                         extra_body={"echo": True, "continue_final_message": True,
                                                     "add_generation_prompt": False})
    text = "".join(c.choices[0].delta.content or "" for c in out) if stream else out.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **GREEDY,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert text == "The color is" + plain.choices[0].message.content


def test_tokenize_token_strs(server, tokenizer):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])


def test_vllm_messages_for_bad_prompts(client):
    with pytest.raises(openai.BadRequestError, match="decoder prompt cannot be empty"):
        client.completions.create(model=MODEL, prompt="", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=".*out of vocabulary.*"):
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stop_token_ids contains token id 49152, which is out of vocab"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"stop_token_ids": [49152]})


def test_chat_completion_stream_options(client):
    """vLLM's test of the same name (a 400 where its older servers answered 422)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    common = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0.0)
    for chunk in client.chat.completions.create(**common, stream=True, stream_options={"include_usage": False}):
        assert chunk.usage is None
    stream = client.chat.completions.create(**common, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": False})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            assert chunk.usage is None
            final = next(stream)
            assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0
            assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
            assert final.choices == []
        else:
            assert chunk.usage is None
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**common, stream=False, stream_options=options)
    last = 0
    for chunk in client.chat.completions.create(**common, extra_body=dict(min_tokens=10), stream=True,
                                                stream_options={"include_usage": True, "continuous_usage_stats": True}):
        assert chunk.usage.prompt_tokens >= 0
        assert last == 0 or chunk.usage.completion_tokens > last or (
            not chunk.choices and chunk.usage.completion_tokens == last)
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        last = chunk.usage.completion_tokens
    assert last == 10


def test_logit_bias_allowed_token_ids_and_bad_words(client, tokenizer):
    """OpenAI's logit_bias (string keys) and vLLM's allowed_token_ids / bad_words, through the
    client as vLLM's tests send them."""
    hello = tokenizer.encode(" hello", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="Say something:", max_tokens=4, logit_bias={str(hello): 100},
                                  extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY)
    assert r.choices[0].token_ids == [hello] * 4
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer me."}],
                                          max_completion_tokens=6, temperature=1.0, seed=5,
                                          extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(chat.choices[0].token_ids) <= set(allowed)
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, **GREEDY)
    word = plain.choices[0].text.split()[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                       extra_body={"bad_words": [word]}, **GREEDY)
    assert word not in banned.choices[0].text.split()
