"""Tool calling: each --tool-call-parser on its format (whole, streamed a character at a time, with
content around the calls, and text that holds no call), the schema of tool_choice="required",
and the OpenAI server driven by the ``openai`` client: auto (one server per parser; the model's
output is steered into that parser's format with a regex, since the default model was not
trained on tool calls), named and required choices (always a valid call: structured output
enforces the tools' schemas), none, the history's tool messages, and vLLM's 400s."""

from __future__ import annotations

import json

import pytest

from octavo.entrypoints.openai.tool_calls import required_schema
from octavo.entrypoints.openai.tool_parsers import PARSERS, ToolCallStream

CALLS = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})]
FORMATS = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
              '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
                   '{"name": "now", "parameters": {}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
               '{"name": "now", "arguments": {}}]',
    "pythonic": '[get_weather(city="Paris", days=[1, 2]), now()]',
}
CONTENT = {"hermes": "Let me check.", "llama3_json": None, "mistral": "Let me check.", "pythonic": None}


def streamed(parser_name: str, text: str, step: int = 1):
    """(content, [(name, arguments)]) from deltas of `step` characters, as the server streams."""
    stream = ToolCallStream(PARSERS[parser_name](), parser_name)
    content, calls = "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for i, cut in enumerate(cuts):
        piece, deltas = stream.deltas(text[:cut], final=i == len(cuts) - 1)
        content += piece
        for d in deltas:
            call = calls.setdefault(d["index"], [None, ""])
            if "id" in d:
                assert call[0] is None and d["type"] == "function", "a call is named once, whole"
                call[0] = d["function"]["name"]
            call[1] += d["function"]["arguments"]
    return content or None, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_each_parser_whole_and_streamed(name, step):
    text = FORMATS[name]
    parsed = PARSERS[name]().parse(text, final=True)
    assert parsed.content == CONTENT[name]
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS
    content, calls = streamed(name, text, step)
    assert content == parsed.content
    assert calls == [(c.name, c.arguments) for c in parsed.calls]


def test_mistral_v11_format():
    text = 'Sure [TOOL_CALLS]get_weather{"city": "Paris", "days": [1, 2]}[TOOL_CALLS]now{}'
    parsed = PARSERS["mistral"]().parse(text, final=True)
    assert parsed.content == "Sure " and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS
    assert streamed("mistral", text)[1] == [(c.name, c.arguments) for c in parsed.calls]


@pytest.mark.parametrize("name, text", [
    ("hermes", "No tools needed; <tool is not a tag>."),
    ("llama3_json", "The answer is {probably} 4."),
    ("mistral", "Plain [TOOL] text."),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[f(x)]"),  # positional arguments are not a call
    ("pythonic", "[f(a=open('x'))]"),  # only literal values
])
def test_text_without_calls_is_content(name, text):
    parsed = PARSERS[name]().parse(text, final=True)
    assert parsed.content == text and parsed.calls == []
    assert streamed(name, text) == (text, [])


def test_llama3_json_calls_followed_by_text_are_text():
    """Whole, such an output is text (vLLM's rule: all calls or none); streamed, the call went out
    before the words after it came, as in vLLM."""
    text = '{"name": "f", "parameters": {"a": 1}} and some words'
    parsed = PARSERS["llama3_json"]().parse(text, final=True)
    assert parsed.content == text and parsed.calls == []


def test_streaming_holds_back_what_may_be_a_marker():
    stream = ToolCallStream(PARSERS["hermes"](), "hermes")
    assert stream.deltas("Hi <tool_", final=False) == ("Hi ", [])
    assert stream.deltas("Hi <tool_x", final=False) == ("<tool_x", [])


def test_a_list_cut_off_by_max_tokens_keeps_its_whole_calls():
    text = '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get_weather", "argum'
    parsed = PARSERS["mistral"]().parse(text, final=True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("now", "{}")]


def test_hermes_unterminated_last_call():
    parsed = PARSERS["hermes"]().parse('<tool_call>{"name": "now", "arguments": {}}', final=True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("now", "{}")]


def test_required_schema_lifts_defs():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}}}}},
        {"type": "function", "function": {"name": "b"}}]
    schema = required_schema(tools)
    assert schema["$defs"] == {"p": {"type": "integer"}} and schema["minItems"] == 1
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


# ---- the server --------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
MODEL = "smol"
pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
# What steers the default model into each parser's format (tool_choice "auto" with this regex).
STEER = {
    "hermes": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)", "days": [1-7]\}\}'
              r'\n</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome|Oslo)", "days": [1-7]\}\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)", '
               r'"days": [1-7]\}\}\]',
    "pythonic": r'\[get_weather\(city="(Paris|Rome|Oslo)", days=[1-7]\)\]',
}


@pytest.fixture(scope="module", params=sorted(STEER))
def parser_server(request, tmp_path_factory):
    from live_server import LiveServer

    s = LiveServer("--served-model-name", MODEL, "--max-model-len", "1024", "--enable-auto-tool-choice",
                   "--tool-call-parser", request.param,
                   log=tmp_path_factory.mktemp(f"tools-{request.param}") / "serve.log")
    yield request.param, s
    s.stop_cleanly()


def client_of(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_weather_call(call):
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome", "Oslo") and 1 <= args["days"] <= 7


def test_auto_tool_choice_through_each_parser(parser_server):
    name, server = parser_server
    client = client_of(server)
    steer = {"structured_outputs": {"regex": STEER[name]}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], temperature=1.0, seed=2,
                                       max_tokens=80, extra_body=steer)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
    check_weather_call(choice.message.tool_calls[0])
    # Streamed: the name once, the arguments in pieces that add up to the same JSON.
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], temperature=1.0,
                                                 seed=2, max_tokens=80, extra_body=steer, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and all(d.index == 0 for d in deltas)
    assert all(d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(choice.message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from live_server import LiveServer

    s = LiveServer("--served-model-name", MODEL, "--max-model-len", "1024",
                   log=tmp_path_factory.mktemp("tools") / "serve.log")
    yield s
    s.stop_cleanly()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_always_gives_a_valid_call(server, seed, stream):
    client = client_of(server)
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, NOW], temperature=1.0, seed=seed, max_tokens=120,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == ""
        check_weather_call(choice.message.tool_calls[0])
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert args["city"] in ("Paris", "Rome", "Oslo")


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_always_gives_valid_calls(server, seed):
    r = client_of(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], temperature=1.0,
                                                  seed=seed, max_tokens=200, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    # The list has no bound: a call cut off by max_tokens is left out, the whole ones are there.
    assert calls and r.choices[0].finish_reason in ("stop", "length")
    for call in calls:
        assert call.function.name in ("get_weather", "now")
        if call.function.name == "get_weather":
            check_weather_call(call)
        else:
            assert isinstance(json.loads(call.function.arguments), dict)


def test_parallel_tool_calls_false_keeps_one(server):
    r = client_of(server).chat.completions.create(
        model=MODEL, messages=ASK, tools=[NOW], temperature=0.0, max_tokens=60, tool_choice="required",
        parallel_tool_calls=False, extra_body={"min_tokens": 0})
    assert len(r.choices[0].message.tool_calls) == 1


def test_tool_choice_none_and_tool_history(server):
    client = client_of(server)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                       temperature=0.0, max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "auto", "tools": [WEATHER]},
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "does not match any of the specified `tools`"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0] must be"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "either use constraints for structured outputs or tools"),
])
def test_bad_tool_requests_are_400s(server, body, message):
    import httpx

    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
