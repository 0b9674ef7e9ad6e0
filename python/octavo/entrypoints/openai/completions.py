"""POST /v1/completions: prompts as text or token ids, n samples each, optionally streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ...outputs import CompletionOutput, Logprob, RequestOutput
from .protocol import MIN_LOGPROB, APIError, CompletionRequest
from .serving import ServedModel, random_id, sse, usage


async def completion_prompts(served: ServedModel, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt; a string, strings, token ids or token-id lists."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError("The decoder prompt cannot be empty.", param="prompt")
    prompts = [(p, await served.encode(p, request.add_special_tokens)) if isinstance(p, str) else (None, list(p))
               for p in prompt]
    return [(text, request.truncate(ids, served.max_model_len)) for text, ids in prompts]


class CompletionRun:
    """One /v1/completions request: checks (``prepare``), then the response built from the
    engine's deltas."""

    def __init__(self, served: ServedModel, request: CompletionRequest):
        served.check_model(request.model)
        if request.suffix is not None:
            raise APIError("suffix is not supported.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError("best_of is not supported (it must equal n when given).", param="best_of")
        served.check_logprobs(request.logprobs, "logprobs")
        served.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        served.check_n(request.n)
        self.served, self.request = served, request
        self.id = random_id("cmpl")
        self.created = int(time.time())
        self.n = request.n

    async def prepare(self) -> None:
        """Tokenizes (off the event loop) and checks every prompt against the engine's limits."""
        served, request = self.served, self.request
        self.prompts = await completion_prompts(served, request)
        echo_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        self.params = request.sampling_params(served.sampling_defaults, request.max_tokens, request.logprobs,
                                              prompt_logprobs=echo_logprobs)
        for _, ids in self.prompts:
            served.check_prompt(ids, self.params)
        longest = max(len(ids) for _, ids in self.prompts)
        self.beam = request.beam_search_params(self.params.max_tokens or served.max_model_len - longest)
        served.check_capacity()

    def _choice(self, i: int, output: RequestOutput, o: CompletionOutput, first: bool, offset: int) -> dict:
        """A choice holding this delta; the echoed prompt goes in front of the first one."""
        text, token_ids, logprobs, prompt_part = o.text, o.token_ids, o.logprobs, first and self.request.echo
        if prompt_part:
            prompt_text = output.prompt if output.prompt is not None else self.served.tokenizer.decode(
                output.prompt_token_ids)
            text = prompt_text + text
        choice = {"index": i * self.n + o.index, "text": text, "logprobs": None,
                  "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        # vLLM's extra fields, null unless asked for.
        request = self.request
        choice["prompt_logprobs"] = None if request.prompt_logprobs is None else self.served.prompt_logprobs(
            output.prompt_logprobs, request.return_tokens_as_token_ids)
        choice["prompt_token_ids"] = output.prompt_token_ids if request.return_token_ids and first else None
        choice["token_ids"] = list(token_ids) if request.return_token_ids else None
        if self.request.logprobs is not None:
            entries = list(zip(token_ids, logprobs or []))
            if prompt_part:
                entries = list(zip(output.prompt_token_ids, output.prompt_logprobs or [])) + entries
            choice["logprobs"] = self._logprobs(entries, offset)
        return choice

    def _logprobs(self, entries: list[tuple[int, dict[int, Logprob] | None]], offset: int) -> dict[str, list]:
        """OpenAI's legacy layout: parallel lists; the first prompt token has no logprob."""
        result = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token_id, entry in entries:
            token = self._token_text(token_id, entry)
            result["text_offset"].append(offset)
            offset += len(token)
            result["tokens"].append(token)
            if entry is None:
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            result["token_logprobs"].append(max(entry[token_id].logprob, MIN_LOGPROB))
            top = {self._token_text(t, entry): max(lp.logprob, MIN_LOGPROB) for t, lp in entry.items()
                   if t == token_id or (lp.rank is not None and lp.rank <= self.request.logprobs)}
            result["top_logprobs"].append(top)
        return result

    def _token_text(self, token_id: int, entry: dict[int, Logprob] | None) -> str:
        lp = entry.get(token_id) if entry is not None else None
        return self.served.token_name(token_id, lp.decoded_token if lp is not None else None,
                                      self.request.return_tokens_as_token_ids)

    def _usage(self, completion_tokens: int, outputs) -> dict[str, Any]:
        return usage(sum(len(ids) for _, ids in self.prompts), completion_tokens, self.served.cached_tokens(outputs))

    async def response(self) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for i, delta in self.served.outputs(self.id, self.prompts, self.params, self.request.priority,
                                                  self.beam):
            if i in finals:
                finals[i].add(delta, aggregate=True)
            else:
                finals[i] = delta
        choices = [self._choice(i, finals[i], o, True, 0) for i in sorted(finals) for o in finals[i].outputs]
        completion_tokens = sum(len(o.token_ids) for out in finals.values() for o in out.outputs)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "choices": choices, "usage": self._usage(completion_tokens, finals.values())}

    async def stream(self) -> AsyncIterator[str]:
        """One chunk per choice delta, as vLLM streams them; with stream_options.include_usage a
        last chunk with the usage (and with continuous_usage_stats, the usage so far in every chunk)."""
        options = self.request.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        sent_any: set[int] = set()
        offsets: dict[int, int] = {}
        completion_tokens = 0
        cached: dict[int, RequestOutput] = {}  # the latest delta of each prompt, for its cache hits
        try:
            async for i, delta in self.served.outputs(self.id, self.prompts, self.params, self.request.priority,
                                                      self.beam):
                cached[i] = delta
                for o in delta.outputs:
                    index = i * self.n + o.index
                    if not (o.text or o.token_ids or o.finish_reason) and index in sent_any:
                        continue
                    choice = self._choice(i, delta, o, index not in sent_any, offsets.get(index, 0))
                    sent_any.add(index)
                    offsets[index] = offsets.get(index, 0) + len(choice["text"])
                    completion_tokens += len(o.token_ids)
                    chunk = {"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.served.name, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = self._usage(completion_tokens, cached.values()) if continuous else None
                    yield sse(chunk)
        except APIError as e:
            yield sse(e.body())
        else:
            if include_usage:
                yield sse({"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.served.name, "choices": [],
                           "usage": self._usage(completion_tokens, cached.values())})
        yield sse("[DONE]")
