"""A chat request's tools, as vLLM serves them: ``tool_choice`` checked against ``tools`` and the
server's flags, the constraint a forced choice puts on the output, and the reply's tool calls.

- ``none``: no calls (the tools still go to the chat template unless the server excludes them).
- ``auto``: free text; the server's --tool-call-parser finds the calls (finish_reason
  "tool_calls" when it does).
- ``required``: the output is a JSON list of ``{"name", "parameters"}`` for the given tools,
  enforced by structured output; each item is a call.
- a named function: the output is that function's arguments, enforced by its JSON schema.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from ...sampling_params import StructuredOutputsParams
from .protocol import APIError
from .tool_parsers import PARSERS, Parsed, ParsedCall, ToolCallStream, calls_in_json_list, make_tool_call_id


@dataclass
class ToolSettings:
    """The server's flags (vLLM's)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


class ToolChoice:
    """One request's tools and tool_choice, checked (APIError otherwise)."""

    def __init__(self, request, settings: ToolSettings):
        self.tools, self.settings = request.tools, settings
        self.parallel = request.parallel_tool_calls is not False
        choice = request.tool_choice
        if self.tools is None:
            if choice not in (None, "none"):
                raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
            self.mode, self.function = "none", None
            return
        for i, tool in enumerate(self.tools):
            if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                    and isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str)):
                raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                               "'parameters': ...}}.", param="tools")
        self.function = None
        if choice is None:
            choice = "auto"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
            self.function = next((t["function"] for t in self.tools if t["function"]["name"] == name), None)
            if self.function is None:
                raise APIError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                               param="tool_choice")
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                           param="tool_choice")
        if choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           param="tool_choice")
        self.mode = choice

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template gets as `tools`."""
        if self.mode == "none" and self.settings.exclude_tools_when_tool_choice_none:
            return None
        return self.tools

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output a forced choice needs (None for none / auto)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.function.get("parameters") or {"type": "object"})
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None

    def stream(self) -> ToolCallStream | None:
        """A choice's streamed calls: None where the reply is plain text."""
        if self.mode == "auto":
            name = self.settings.tool_call_parser
            return ToolCallStream(PARSERS[name](), name)
        if self.mode == "named":
            return ToolCallStream(_NamedParser(self.function["name"]), "named")
        if self.mode == "required":
            return ToolCallStream(_RequiredParser(), "required")
        return None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The reply's message for a choice's whole text, and whether it holds tool calls."""
        stream = self.stream()
        if stream is None:
            return {"role": "assistant", "content": text}, False
        parsed = stream.parser.parse(text, final=True)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        if not calls:
            return {"role": "assistant", "content": text}, False
        parser = self.settings.tool_call_parser if self.mode == "auto" else self.mode
        tool_calls = [{"id": make_tool_call_id(parser), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        # As vLLM: a forced call's message has empty content; auto keeps the text before the calls.
        content = parsed.content if self.mode == "auto" else ""
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}, True

    def finish_reason(self, engine_reason: str | None, has_calls: bool) -> str | None:
        """vLLM's: "tool_calls" when auto found calls; forced calls keep the engine's reason."""
        return "tool_calls" if has_calls and self.mode == "auto" and engine_reason == "stop" else engine_reason


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's schema for tool_choice="required": a non-empty list of calls of the given tools,
    each tool's $defs lifted to the top (where its $refs point); one call without parallel calls."""
    defs: dict = {}
    variants = []
    for tool in tools:
        params = copy.deepcopy(tool["function"].get("parameters") or {"type": "object"})
        defs.update(params.pop("$defs", {}))
        variants.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class _NamedParser:
    """tool_choice naming a function: the whole output is its arguments."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed(None, [ParsedCall(self.name, text.lstrip())])


class _RequiredParser:
    """tool_choice="required": ``[{"name": ..., "parameters": {...}}, ...]``."""

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        return Parsed(None, calls_in_json_list(body, final, ("parameters",)) if body.startswith("[") else [])


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool_calls in the history with their arguments as objects, which chat templates
    iterate over (OpenAI sends them as JSON text); vLLM does the same."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
