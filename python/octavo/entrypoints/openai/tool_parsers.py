"""Tool-call parsers (vLLM's ``--tool-call-parser``): each reads a model's text as content plus
function calls in the format the model was trained on.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated; content is
  the text before the first tag.
- ``llama3_json``: an optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}``
  objects separated by ``;``; the whole output is calls or none is.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (tokenizer v11+)
  ``[TOOL_CALLS]name{...}`` repeated; content is the text before the first marker.
- ``pythonic``: the whole output is a Python list of calls with literal keyword arguments,
  ``[get_weather(city="Paris"), now()]``.

``parse(text, final)`` gives the content and the calls found so far. While streaming
(final=False) a parser holds back text that may be the start of its marker, names a call only
once its name is complete, and gives the arguments' text as far as it is written; ToolCallStream
turns successive parses into OpenAI deltas. Arguments are JSON text (the model's own where it
wrote JSON, so that the streamed pieces add up to valid JSON).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str | None  # None until its name is complete
    arguments: str  # JSON text, complete or (while streaming) a prefix of it


@dataclass
class Parsed:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array opening at text[start], or None while unclosed."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of text could begin marker (not shown while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def call_from_json_object(body: str, final: bool, argument_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """A ``{"name": ..., "<arguments key>": {...}}`` object, whole (final: None unless it is valid
    JSON) or begun. The arguments are the model's own JSON text."""
    keys = "|".join(re.escape(k) for k in argument_keys)
    at = re.search(r'"(?:%s)"\s*:\s*(?=[{\[])' % keys, body)
    end = json_value_end(body, at.end()) if at else None
    # The call's own "name", not one inside its arguments.
    name = _NAME.search(body[:at.start()] if at else body) or (_NAME.search(body, end) if end else None)
    if final:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        raw = body[at.end():end] if end else None
        value = next((obj[k] for k in argument_keys if k in obj), {})
        return ParsedCall(obj["name"], raw if raw is not None else json.dumps(value, ensure_ascii=False))
    name = json.loads(f'"{name.group(1)}"') if name else None
    return ParsedCall(name, body[at.end():end] if at else "")


def calls_in_json_list(body: str, final: bool, argument_keys: tuple[str, ...] = ("arguments",)) -> list[ParsedCall]:
    """The calls of a ``[{"name": ..., "<arguments key>": {...}}, ...]`` list (body starts at its
    "["): the whole objects, and while streaming the one being written; a final text cut off
    inside an object (max_tokens) keeps the whole ones."""
    calls, at = [], 1
    while (start := body.find("{", at)) >= 0:
        end = json_value_end(body, start)
        if final and end is None:
            break
        call = call_from_json_object(body[start:end], final, argument_keys)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        at = end
    return calls


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            keep = len(text) - (0 if final else held_back(text, self.START))
            return Parsed(text[:keep] or None)
        calls = []
        for body, closed in self._bodies(text[first:]):
            call = call_from_json_object(body.strip(), final or closed)
            if call is not None:
                calls.append(call)
        return Parsed(text[:first] or None, calls)

    def _bodies(self, text: str):
        for part in text.split(self.START)[1:]:
            body, closed, _ = part.partition(self.END)
            yield body, bool(closed)


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        if tagged:
            body = body[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(body):
            return Parsed(None)  # may still become the tag
        if not body.startswith("{"):
            return Parsed(None if tagged and not body and not final else text or None)
        calls, at = [], 0
        while at < len(body) and body[at] == "{":
            end = json_value_end(body, at)
            call = call_from_json_object(body[at:end], final or end is not None, ("parameters", "arguments"))
            if call is None or end is None:
                if call is not None:
                    calls.append(call)
                break
            calls.append(call)
            at = end + len(body[end:]) - len(body[end:].lstrip().removeprefix(";").lstrip())
        if final and (not calls or at < len(body)):
            return Parsed(text)  # not all calls: plain text, as vLLM
        return Parsed(None, calls)


class MistralParser:
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.MARKER)
        if first < 0:
            keep = len(text) - (0 if final else held_back(text, self.MARKER))
            return Parsed(text[:keep] or None)
        rest = text[first + len(self.MARKER):].lstrip()
        # A JSON list of calls before tokenizer v11, then name{arguments} after each marker.
        calls = calls_in_json_list(rest, final) if rest.startswith("[") else self._named(text[first:], final)
        return Parsed(text[:first] or None, calls)

    def _named(self, text: str, final: bool) -> list[ParsedCall]:
        """``[TOOL_CALLS]name{args}`` repeated (Mistral's v11 tokenizer format)."""
        calls = []
        for part in text.split(self.MARKER)[1:]:
            brace = part.find("{")
            if brace < 0:
                continue
            end = json_value_end(part, brace)
            if final and end is None:
                continue
            calls.append(ParsedCall(part[:brace].strip(), part[brace:end]))
        return calls


class PythonicParser:
    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        if not body.startswith("["):
            return Parsed(text or None)
        calls, complete = self._calls(body)
        if final and not (complete and calls):
            return Parsed(text)  # not a whole list of calls: plain text
        return Parsed(None, calls)

    def _calls(self, body: str) -> tuple[list[ParsedCall], bool]:
        """The calls whose text is whole; and whether the list is closed right after them."""
        calls, start, depth, quote = [], 1, 0, None
        for i in range(1, len(body)):
            c = body[i]
            if quote:
                if c == quote and body[i - 1] != "\\":
                    quote = None
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}" and depth > 0:
                depth -= 1
            elif c in ",]" and depth == 0:
                call = _python_call(body[start:i])
                if call is None:
                    return calls, False
                calls.append(call)
                start = i + 1
                if c == "]":
                    return calls, not body[i + 1:].strip()
        return calls, False


def _python_call(source: str) -> ParsedCall | None:
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError, TypeError):
        return None
    return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False))


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "llama4_json": Llama3JsonParser,
           "mistral": MistralParser, "pythonic": PythonicParser}


def make_tool_call_id(parser: str) -> str:
    if parser == "mistral":  # Mistral's templates want 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallStream:
    """One choice's streamed tool calls: each parse of the text so far against what was sent."""

    def __init__(self, parser, parser_name: str):
        self.parser, self.parser_name = parser, parser_name
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # per call: id, characters of arguments sent

    def deltas(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, new tool-call deltas) for the text so far."""
        parsed = self.parser.parse(text, final)
        content = (parsed.content or "")[self.content_sent:]
        self.content_sent += len(content)
        out = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self.sent):
                self.sent.append((make_tool_call_id(self.parser_name), 0))
                out.append({"index": index, "id": self.sent[index][0], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            call_id, done = self.sent[index]
            if len(call.arguments) > done:
                piece = call.arguments[done:]
                self.sent[index] = (call_id, len(call.arguments))
                if out and out[-1]["index"] == index:
                    out[-1]["function"]["arguments"] += piece
                else:
                    out.append({"index": index, "function": {"arguments": piece}})
        return content, out
