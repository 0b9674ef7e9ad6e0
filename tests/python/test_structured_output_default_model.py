"""Structured output on the real default model (SmolLM2-135M-Instruct), through LLM and through
the OpenAI client: 50 JSON schemas (json_schemas.py), greedy and sampled at temperature 1, where
every output must parse and validate with jsonschema; regexes and choices, where every output
must match; and the server's 400s for constraints that cannot compile."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from json_schemas import SCHEMAS  # noqa: E402

from octavo import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from octavo.default_model import default_model_path  # noqa: E402

MAX_TOKENS = 400

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{5,30}\.", r"[A-Z][a-z]{2,10} [A-Z][a-z]{2,10}",
           r"#[0-9a-f]{6}", r"(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?", r"[a-z]{1,12}@[a-z]{1,10}\.(com|org)"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Rome"], ["A", "B", "C", "D"],
           ["true", "false"]]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(default_model_path()), device="cpu", dtype="float32", kv_cache_memory_bytes=512 << 20,
               max_model_len=1024)


def chat(tokenizer, request: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                         add_generation_prompt=True)


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_schemas_through_llm(llm, temperature):
    tokenizer = llm.get_tokenizer()
    prompts = [chat(tokenizer, f"Reply with {what} as JSON.") for what, _ in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, (_, schema) in enumerate(SCHEMAS)]
    for (what, schema), out in zip(SCHEMAS, llm.generate(prompts, params, use_tqdm=False)):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (what, o.text)
        check_json(o.text, schema)
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regexes_and_choices_through_llm(llm, temperature):
    tokenizer = llm.get_tokenizer()
    cases = [(StructuredOutputsParams(regex=r), lambda t, r=r: re.fullmatch(r, t)) for r in REGEXES]
    cases += [(StructuredOutputsParams(choice=c), lambda t, c=c: t in c) for c in CHOICES]
    prompts = [chat(tokenizer, "Answer briefly: what do you think?")] * len(cases)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=64, structured_outputs=so)
              for i, (so, _) in enumerate(cases)]
    for (_, check), out in zip(cases, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


# ---- the OpenAI server -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from live_server import LiveServer

    s = LiveServer("--max-model-len", "1024", log=tmp_path_factory.mktemp("structured") / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_fifty_schemas_through_the_openai_client(client):
    model = client.models.list().data[0].id

    def ask(i: int):
        what, schema = SCHEMAS[i]
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Reply with {what} as JSON."}],
            temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return r.choices[0]

    with ThreadPoolExecutor(16) as pool:
        for (what, schema), choice in zip(SCHEMAS, pool.map(ask, range(len(SCHEMAS)))):
            assert choice.finish_reason == "stop", (what, choice.message.content)
            check_json(choice.message.content, schema)


def test_json_object_regex_and_choice_through_the_openai_client(client):
    model = client.models.list().data[0].id
    # json_object bounds nothing: asked for free-form JSON, this small model nests or repeats until
    # max_tokens; one example in the chat keeps its answer short.
    messages = [{"role": "user", "content": "A JSON object naming a dog."},
                {"role": "assistant", "content": '{"name": "Rex"}'},
                {"role": "user", "content": "A JSON object naming a cat."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=1,
                                       n=4, response_format={"type": "json_object"})
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c.message.content
    r = client.completions.create(model=model, prompt="My phone number is", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"regex": REGEXES[0]}})
    assert re.fullmatch(REGEXES[0], r.choices[0].text)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, n=3, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": CHOICES[1]}})
    assert all(c.message.content in CHOICES[1] for c in r.choices)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "properties": 5}}}},
     "response_format", "Failed to transform json schema into a grammar: properties must"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "When response_format type is 'json_schema', the 'json_schema' field must be provided."),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format type must be one of"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Failed to transform regex into a grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "only use one kind"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "Invalid grammar specification"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "unexpected keyword argument 'regx'"),
])
def test_constraints_that_cannot_compile_are_400s(server, body, param, message):
    import httpx

    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param and error["code"] == 400
    # The engine runs on: the next request completes.
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200
