"""POST /v1/chat/completions: messages through the model's chat template, optionally streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ... import structured_output
from ...outputs import CompletionOutput, Logprob, RequestOutput
from .protocol import MIN_LOGPROB, APIError, ChatCompletionRequest
from .reasoning_parsers import ReasoningStream, ThinkParser
from .serving import ServedModel, random_id, sse, usage
from .tool_calls import ToolChoice, template_messages
from .tool_parsers import ToolCallStream


class ChatRun:
    """One /v1/chat/completions request: checks (``prepare``), then the response built from the
    engine's deltas."""

    def __init__(self, served: ServedModel, request: ChatCompletionRequest):
        served.check_model(request.model)
        self.tools = ToolChoice(request, served.tool_settings)
        response_format = request.response_format or {}
        constrained = request.structured_outputs is not None or response_format.get("type", "text") != "text"
        if self.tools.constraint() is not None and constrained:
            raise APIError("You can only either use constraints for structured outputs or tools, not both.",
                           param="tool_choice")
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        self.top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if self.top_logprobs == -1:  # the whole vocabulary, as in vLLM
            self.top_logprobs = len(served.tokenizer)
        served.check_logprobs(self.top_logprobs, "top_logprobs")
        served.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        served.check_n(request.n)
        parser = served.reasoning_parser
        self.reasoning = parser if parser is not None and parser.thinks(request.chat_template_kwargs) else None
        self.served, self.request = served, request
        self.id = random_id("chatcmpl")
        self.created = int(time.time())

    async def prepare(self) -> None:
        """Renders the chat and tokenizes it (off the event loop), then checks it against the
        engine's limits."""
        served, request = self.served, self.request
        text = await served.render_chat(template_messages(request.messages), request.add_generation_prompt,
                                        request.continue_final_message, request.chat_template,
                                        request.chat_template_kwargs, self.tools.template_tools)
        token_ids = await served.encode(text, request.add_special_tokens, param="messages")
        self.prompts = [(text, request.truncate(token_ids, served.max_model_len))]
        last = request.messages[-1] if request.messages else {}
        # echo: the reply continues the last message when it is the assistant's (vLLM's rule).
        self.echo = last.get("content") or "" if request.echo and last.get("role") == "assistant" else ""
        if not isinstance(self.echo, str):
            self.echo = "".join(part.get("text", "") for part in self.echo if isinstance(part, dict))
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        self.params = request.sampling_params(served.sampling_defaults, max_tokens, self.top_logprobs)
        if self.tools.mode == "auto":  # the parsers read markers that may be special tokens, as vLLM's
            self.params.skip_special_tokens = False
        forced = self.tools.constraint()  # a named or required tool choice: the calls' JSON schema
        if forced is not None:
            try:
                structured_output.validate(forced)
            except ValueError as e:
                raise APIError(f"The tools' parameters are not a JSON schema the server can follow: {e}",
                               param="tools") from None
            self.params.structured_outputs = forced
        prompt = self.prompts[0][1]
        so = self.params.structured_outputs
        if so is not None and self.reasoning is not None and not self.reasoning.ended_in_prompt(prompt):
            so._reasoning_end = self.reasoning.end_id  # the answer follows the constraint, not the thinking
        served.check_prompt(prompt, self.params)
        self.beam = request.beam_search_params(self.params.max_tokens or served.max_model_len - len(prompt))
        served.check_capacity()

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A whole choice's message (reasoning, content, tool calls) and whether it holds calls."""
        reasoning, answer = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        message, has_calls = self.tools.message(answer)
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        if reasoning is not None:
            message["content"] = message["content"] or None
            if self.request.include_reasoning:  # vLLM's field, and its older name
                message["reasoning"] = message["reasoning_content"] = reasoning or None
        return message, has_calls

    def _logprobs(self, o: CompletionOutput) -> dict[str, list] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [self._token_logprob(t, entry) for t, entry in zip(o.token_ids, o.logprobs or [])]}

    def _token_logprob(self, token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
        top = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= self.top_logprobs)
        return {**self._candidate(token_id, entry[token_id]),
                "top_logprobs": [self._candidate(t, lp) for _, t, lp in top]}

    def _candidate(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        token = self.served.token_name(token_id, lp.decoded_token, self.request.return_tokens_as_token_ids)
        return {"token": token, "logprob": max(lp.logprob, MIN_LOGPROB), "bytes": list(token.encode("utf-8"))}

    def _chunk(self, choices: list[dict], **extra) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.served.name, "choices": choices, **extra}

    def _usage(self, completion_tokens: int, output: RequestOutput | None) -> dict[str, Any]:
        return usage(len(self.prompts[0][1]), completion_tokens,
                     self.served.cached_tokens([output] if output is not None else []))

    def _extras(self, output: RequestOutput) -> dict[str, Any]:
        """The response's top-level prompt fields (vLLM's extras), null unless asked for."""
        request = self.request
        return {"prompt_logprobs": None if request.prompt_logprobs is None else self.served.prompt_logprobs(
                    output.prompt_logprobs, request.return_tokens_as_token_ids),
                "prompt_token_ids": output.prompt_token_ids if request.return_token_ids else None}

    async def response(self) -> dict[str, Any]:
        final: RequestOutput | None = None
        async for _, delta in self.served.outputs(self.id, self.prompts, self.params, self.request.priority,
                                                  self.beam):
            if final is None:
                final = delta
            else:
                final.add(delta, aggregate=True)
        choices = []
        for o in final.outputs:
            message, has_calls = self._message(o.text)
            choice = {"index": o.index, "message": message, "logprobs": self._logprobs(o),
                      "finish_reason": self.tools.finish_reason(o.finish_reason, has_calls),
                      "stop_reason": o.stop_reason}
            choice["token_ids"] = list(o.token_ids) if self.request.return_token_ids else None
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.served.name,
                "choices": choices, "usage": self._usage(sum(len(o.token_ids) for o in final.outputs), final),
                **self._extras(final)}

    async def stream(self) -> AsyncIterator[str]:
        """The role first, then one chunk per choice delta, as vLLM streams them; with
        stream_options.include_usage a last chunk with the usage (and with continuous_usage_stats,
        the usage so far in every chunk)."""
        options = self.request.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        completion_tokens = 0
        last = None

        def usage_so_far() -> dict[str, Any]:
            return {"usage": self._usage(completion_tokens, last) if continuous else None} if include_usage else {}

        extras = {"prompt_token_ids": self.prompts[0][1]} if self.request.return_token_ids else {}
        choices = self.request.n if self.beam else self.params.n
        streams = [_StreamedChoice(self.reasoning, self.tools.stream(), self.tools.parallel,
                                   self.request.include_reasoning) for _ in range(choices)]
        for i in range(choices):
            yield sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], **extras, **usage_so_far()))
            if self.echo:
                yield sse(self._chunk([{"index": i, "delta": {"content": self.echo}, "logprobs": None,
                                        "finish_reason": None}], **usage_so_far()))
        try:
            async for _, delta in self.served.outputs(self.id, self.prompts, self.params, self.request.priority,
                                                      self.beam):
                last = delta
                for o in delta.outputs:
                    if not (o.text or o.token_ids or o.finish_reason):
                        continue
                    completion_tokens += len(o.token_ids)
                    stream = streams[o.index]
                    change = stream.delta(o.text, final=o.finish_reason is not None)
                    choice = {"index": o.index, "delta": change, "logprobs": self._logprobs(o),
                              "finish_reason": self.tools.finish_reason(o.finish_reason, stream.has_calls),
                              "stop_reason": o.stop_reason}
                    if self.request.return_token_ids:
                        choice["token_ids"] = list(o.token_ids)
                    yield sse(self._chunk([choice], **usage_so_far()))
        except APIError as e:
            yield sse(e.body())
        else:
            if include_usage:
                yield sse(self._chunk([], usage=self._usage(completion_tokens, last)))
        yield sse("[DONE]")


class _StreamedChoice:
    """One streamed choice: its text so far, cut into reasoning, content and tool calls as it
    grows (each part's parser holds back what may still turn out to be a marker)."""

    def __init__(self, reasoning: ThinkParser | None, calls: ToolCallStream | None, parallel: bool,
                 include_reasoning: bool):
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.calls, self.parallel, self.include_reasoning = calls, parallel, include_reasoning
        self.text, self.content_sent = "", 0

    @property
    def has_calls(self) -> bool:
        return self.calls is not None and bool(self.calls.sent)

    def delta(self, piece: str, final: bool) -> dict[str, Any]:
        if self.reasoning is None and self.calls is None:
            return {"content": piece} if piece else {}
        self.text += piece
        thought, answer = self.reasoning.advance(self.text, final) if self.reasoning else ("", self.text)
        delta: dict[str, Any] = {}
        if thought and self.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = thought
        if self.calls is None:
            content, self.content_sent = answer[self.content_sent:], len(answer)
        else:
            content, tool_calls = self.calls.deltas(answer, final)
            tool_calls = tool_calls if self.parallel else [c for c in tool_calls if c["index"] == 0]
            if tool_calls:
                delta["tool_calls"] = tool_calls
        if content:
            delta["content"] = content
        return delta
