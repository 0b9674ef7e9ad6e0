"""What every endpoint shares: the served model, request checks, and running a group of prompts
on the ``AsyncLLM`` as one merged stream of delta outputs."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from ...engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestFailedError
from ...beam_search import BeamSearch
from ...outputs import CompletionOutput, RequestOutput
from ...sampling_params import BeamSearchParams, SamplingParams
from .protocol import MIN_LOGPROB, APIError
from .template_sandbox import TemplateError, TemplateSandbox
from .tool_calls import ToolSettings


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event, as OpenAI streams them."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


# A token's text has at most this many characters times the longest token string in the
# vocabulary (byte-level tokens spell each byte with one character; the margin covers
# normalizers that merge characters). Longer text cannot fit max_model_len, so it is refused
# before the tokenizer spends seconds on it.
_CHARS_PER_TOKEN_MARGIN = 4


def longest_token_chars(tokenizer) -> int:
    return max(len(token) for token in tokenizer.get_vocab())


@dataclass
class ServedModel:
    """The model the server answers for, the limits it enforces on each request, and the
    threads that tokenize and render chat templates off the event loop."""

    engine: AsyncLLM
    tokenizer: Any  # the front end's own copy: HF tokenizers must not be shared across threads
    names: list[str]
    root: str
    max_model_len: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from the model's generation config
    max_logprobs: int = 20
    max_n: int = 128
    request_timeout: float | None = None
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    chat_template: str | None = None  # the operator's --chat-template (None: the model's own)
    tool_settings: ToolSettings = field(default_factory=ToolSettings)  # --enable-auto-tool-choice, ...
    reasoning_parser: Any = None  # --reasoning-parser's ThinkParser, or None
    templates: TemplateSandbox = field(default_factory=TemplateSandbox)  # request-supplied templates
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        # One thread each: the tokenizer is used by one thread at a time, and a template that
        # runs until its timeout holds up only other request-supplied templates.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="octavo-tokenizer")
        self._template_thread = ThreadPoolExecutor(1, thread_name_prefix="octavo-chat-template")
        self.max_prompt_chars = self.max_model_len * longest_token_chars(self.tokenizer) * _CHARS_PER_TOKEN_MARGIN

    @property
    def name(self) -> str:
        return self.names[0]

    def close(self) -> None:
        self.templates.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self._template_thread.shutdown(wait=False, cancel_futures=True)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND, param="model")

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(f"n={n} is more than the server's limit of {self.max_n} (--max-n)", param="n")

    def check_capacity(self) -> None:
        """503 + Retry-After when the waiting queue is full, before any response starts."""
        engine = self.engine
        if not engine.is_running:
            raise APIError("The server is shutting down.", HTTPStatus.SERVICE_UNAVAILABLE)
        limit = engine.max_waiting_requests
        if limit is not None and engine.num_waiting() >= limit:
            raise APIError(f"The server is overloaded: {engine.num_waiting()} requests are waiting (limit {limit}). "
                           "Retry later.", HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})

    def check_logprobs(self, num: int | None, param: str) -> None:
        if num is not None and self.max_logprobs != -1 and num > self.max_logprobs:  # -1: no limit
            raise APIError(f"{param}={num} is more than the server's limit of {self.max_logprobs}", param=param)

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise APIError("The decoder prompt cannot be empty.", param="prompt")
        asked = len(token_ids) + (params.max_tokens or 1)
        if asked > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {asked} tokens ({len(token_ids)} in the messages, {params.max_tokens or 1} "
                           "in the completion). Please reduce the length of the messages or completion.",
                           param="max_tokens")
        try:
            self.engine.check_request(token_ids, params)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None

    def check_text(self, text: str, param: str) -> None:
        """Text the tokenizer can take and that can fit the model: a 400 otherwise."""
        if len(text) > self.max_prompt_chars:
            raise APIError(f"The {param} has {len(text)} characters, more than {self.max_model_len} tokens "
                           f"(this model's maximum context length) can hold.", param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"The {param} is not valid Unicode text: {e.reason} at character {e.start}.",
                           param=param) from None

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self.check_text(text, param)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def decode(self, token_ids: list[int]) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self.tokenizer.decode,
                                                                token_ids)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None,
                          chat_template_kwargs: dict[str, Any] | None, tools: list[dict] | None = None) -> str:
        conversation = [_text_message(m, i) for i, m in enumerate(messages)]
        if not conversation:
            raise APIError("messages must not be empty.", param="messages")
        if add_generation_prompt and continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true.",
                           param="continue_final_message")
        kwargs = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                  "continue_final_message": continue_final_message}
        if tools is not None:
            kwargs["tools"] = tools
        loop = asyncio.get_running_loop()
        try:
            if chat_template is None:
                text = await loop.run_in_executor(self._tokenizer_thread, self._render_trusted, conversation, kwargs)
            else:
                special = {k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)}
                text = await loop.run_in_executor(self._template_thread, self.templates.render, conversation,
                                                  chat_template, {**special, **kwargs}, self.max_prompt_chars)
        except TemplateError as e:
            raise APIError(f"The chat template could not render these messages: {e}", param="chat_template") \
                from None
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (bad roles, ...)
            raise APIError(f"The chat template could not render these messages: {e}", param="messages") from None
        self.check_text(text, "messages")
        return text

    def tokenizer_info(self) -> dict[str, Any]:
        """GET /tokenizer_info: the tokenizer's class and its JSON-representable settings."""
        info = {"tokenizer_class": type(self.tokenizer).__name__}
        for key, value in self.tokenizer.init_kwargs.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            info[key] = value
        info["chat_template"] = self.chat_template or self.tokenizer.chat_template
        return info

    def _render_trusted(self, conversation: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """The operator's --chat-template or the model's own, in this process."""
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                  **kwargs)

    def cached_tokens(self, outputs) -> int | None:
        """Prompt tokens read from the prefix cache over ``outputs``, when the server reports them."""
        if not self.enable_prompt_tokens_details:
            return None
        return sum(o.num_cached_tokens or 0 for o in outputs)

    def token_name(self, token_id: int, text: str | None, as_token_ids: bool | None = None) -> str:
        """A token in logprobs: its text, or "token_id:N" (--return-tokens-as-token-ids, or the
        request's return_tokens_as_token_ids)."""
        if self.return_tokens_as_token_ids if as_token_ids is None else as_token_ids:
            return f"token_id:{token_id}"
        return text if text is not None else self.tokenizer.decode([token_id])

    def prompt_logprobs(self, entries: list | None, as_token_ids: bool | None) -> list | None:
        """vLLM's JSON form of prompt logprobs: None for the first token, then {token id: {logprob,
        rank, decoded_token}} per prompt token."""
        if entries is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                     "decoded_token": self.token_name(t, lp.decoded_token, as_token_ids)}
            for t, lp in entry.items()} for entry in entries]

    async def stream(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                     params: SamplingParams, priority: int = 0) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs every prompt and yields (prompt index, delta output) as outputs arrive, until all
        have finished. Leaving early aborts the ones still running."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, text: str | None, token_ids: list[int]) -> None:
            try:
                async for output in self.engine.generate(f"{request_id}-{i}", token_ids, params, prompt=text,
                                                         priority=priority):
                    queue.put_nowait((i, output))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, text, ids)) for i, (text, ids) in enumerate(prompts)]
        deadline = None if self.request_timeout is None else asyncio.get_running_loop().time() + self.request_timeout
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await self._next(queue, deadline)
                if isinstance(item, Exception):
                    raise _api_error(item)
                remaining -= item.finished
                yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def outputs(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                      priority: int = 0, beam: BeamSearchParams | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """stream(), or with ``beam`` each prompt's beam search, as one final output per prompt."""
        if beam is None:
            async for item in self.stream(request_id, prompts, params, priority):
                yield item
            return
        searches = [BeamSearch(ids, beam, self.tokenizer.eos_token_id) for _, ids in prompts]
        for step in range(beam.max_tokens):
            active = [s for s in searches if not s.done]
            if not active:
                break
            beams = [(s, tokens) for s in active for tokens in s.step_requests()]
            entries: dict[int, dict] = {}
            async for j, out in self.stream(f"{request_id}-beam{step}", [(None, t) for _, t in beams],
                                            active[0].sampling_params(), priority):
                if out.outputs and out.outputs[0].logprobs:
                    entries[j] = out.outputs[0].logprobs[0]
            for s in active:
                s.advance([entries[j] for j, (owner, _) in enumerate(beams) if owner is s])
        for i, ((text, ids), search) in enumerate(zip(prompts, searches)):
            result = search.output(self.tokenizer)
            outputs = [CompletionOutput(k, b.text, b.tokens[len(ids):], b.cum_logprob, None, b.finish_reason)
                       for k, b in enumerate(result.sequences)]
            yield i, RequestOutput(f"{request_id}-{i}", text, ids, None, outputs, finished=True)

    async def _next(self, queue: asyncio.Queue, deadline: float | None):
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except asyncio.TimeoutError:
            raise APIError(f"The request did not finish within the server's {self.request_timeout} s timeout.",
                           HTTPStatus.GATEWAY_TIMEOUT) from None


def _api_error(e: Exception) -> APIError:
    """The client's view of an engine error: internal details stay in the server log."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return APIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(e, ValueError):
        return APIError(str(e))
    if isinstance(e, RequestFailedError):
        return APIError(f"The server aborted this request: {e}. The server log has the details.",
                        HTTPStatus.INTERNAL_SERVER_ERROR)
    return APIError("Internal server error.", HTTPStatus.INTERNAL_SERVER_ERROR)


def _text_message(message: Any, i: int) -> dict[str, Any]:
    """A chat message with its content as one string (text parts joined), or a 400."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(f"messages[{i}] must be an object with a string 'role'.", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"messages[{i}].content: only text parts are supported.", param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string or a list of text parts.", param="messages")
    return {**message, "content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` (prefix-cache hits) only when the server reports them."""
    result: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        result["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return result
