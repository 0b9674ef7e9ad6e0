"""Output processing: a request's new tokens become text, logprobs and RequestOutputs.

The engine hands each step's accepted tokens here; this module detokenizes them incrementally,
checks stop strings, assembles logprob entries from the sampler's arrays, and shapes outputs as
the request's ``output_kind`` asks (cumulative, DELTA with a stop-string hold-back, or FINAL_ONLY).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..executor.step_io import PromptLogprobs, SamplerOutput
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .detokenizer import IncrementalDetokenizer, check_stop_strings


@dataclass
class SampleState:
    """One of a request's n samples: one scheduler request."""

    index: int
    core_id: str  # its request id in the engine core: "<request id>#<index>"
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What earlier DELTA outputs carried: token, logprob and character counts; done once the
    # finish reason went out.
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_text: int = 0
    sent_final: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list | None = None  # one entry per prompt token (the first stays None)
    num_cached_tokens: int | None = None  # prompt tokens the first sample found in the prefix cache

    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def detokenizer(self, request: RequestState) -> IncrementalDetokenizer | None:
        p = request.params
        if self.tokenizer is None or not p.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens,
                                      p.spaces_between_special_tokens)

    def append(self, request: RequestState, sample: SampleState, new: list[int], sampled: SamplerOutput | None,
               row: int, stop_terminated: bool = False) -> bool:
        """Adds row ``row``'s new tokens to ``sample``; True when a stop string ended it (the
        scheduler must then abort it). ``stop_terminated``: the last token is a stop token (EOS or
        stop_token_ids) that ended the request; as in vLLM its text is left out unless
        include_stop_str_in_output (its id stays in token_ids). Several tokens in one step
        (speculative decoding) are checked for stop strings one at a time, so that the output
        ends where it would have ended had they come one step each."""
        now = time.time()
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.first_scheduled_time = now
            metrics.time_in_queue = now - metrics.arrival_time
        metrics.last_token_time = now
        first = row if sampled is None or sampled.offsets is None else int(sampled.offsets[row])
        if len(new) == 1 or not request.params.stop or sample.detokenizer is None:
            return self._append_tokens(request, sample, new, sampled, first, stop_terminated)
        last = len(new) - 1
        return any(self._append_tokens(request, sample, [token], sampled, first + j, stop_terminated and j == last)
                   for j, token in enumerate(new))

    def _append_tokens(self, request: RequestState, sample: SampleState, new: list[int],
                       sampled: SamplerOutput | None, first: int, stop_terminated: bool) -> bool:
        """``new``'s sampler rows start at ``first``."""
        sample.output_token_ids.extend(new)
        if sample.logprobs is not None and sampled is not None and sampled.logprobs is not None:
            for i in range(first, first + len(new)):
                sample.cumulative_logprob += float(sampled.logprobs[i])
                sample.logprobs.append(self._logprob_entry(request.params, sampled, i))
        if sample.detokenizer is None:
            return False
        if stop_terminated and not request.params.include_stop_str_in_output:
            new = new[:-1]
        delta = sample.detokenizer.add_tokens(new)
        stop = request.params.stop
        if not stop or sample.finish_reason is not None:
            return False
        text, hit = check_stop_strings(sample.detokenizer.text, len(delta), stop,
                                       request.params.include_stop_str_in_output)
        if hit is None:
            return False
        sample.detokenizer.text = text
        sample.finish_reason, sample.stop_reason = "stop", hit
        return True

    def _logprob_entry(self, params: SamplingParams, sampled: SamplerOutput, i: int) -> dict[int, Logprob]:
        decode = self.decode if params.detokenize else (lambda _: None)
        token = int(sampled.token_ids[i])
        entry = {token: Logprob(float(sampled.logprobs[i]), int(sampled.ranks[i]), decode(token))}
        num = sampled.top_token_ids.shape[1] if params.logprobs == -1 else params.logprobs  # -1: every token
        for j in range(num):
            t = int(sampled.top_token_ids[i, j])
            entry.setdefault(t, Logprob(float(sampled.top_logprobs[i, j]), j + 1, decode(t)))
        return entry

    def record_prompt_logprobs(self, request: RequestState, first: int, chunk: PromptLogprobs) -> None:
        """Fills the entries of prompt tokens first + 1 .. of ``request`` from a worker's chunk:
        the prompt token with its rank, plus the top-k tokens ranked 1..k."""
        decode = self.decode
        targets = request.prompt_token_ids[first + 1:first + 1 + len(chunk.logprobs)]
        for j, token in enumerate(targets):
            entry = {token: Logprob(float(chunk.logprobs[j]), int(chunk.ranks[j]), decode(token))}
            for rank, (t, lp) in enumerate(zip(chunk.top_token_ids[j].tolist(), chunk.top_logprobs[j].tolist()),
                                           start=1):
                entry.setdefault(t, Logprob(lp, rank, decode(t)))
            request.prompt_logprobs[first + 1 + j] = entry

    def decode(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def output(self, request: RequestState) -> RequestOutput | None:
        """The request's output as its ``output_kind`` asks; None when it has nothing to show."""
        finished = request.finished()
        if finished:
            request.metrics.finished_time = time.time()
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            hold_back = request.params.output_text_buffer_length
            outputs = [o for s in request.samples if (o := _delta(s, hold_back)) is not None]
        else:  # copies: later steps extend the sample's lists in place
            outputs = [_completion(s, s.detokenizer.text if s.detokenizer else "", list(s.output_token_ids),
                                   None if s.logprobs is None else list(s.logprobs)) for s in request.samples]
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, prompt_logprobs=request.prompt_logprobs,
                             outputs=outputs, finished=finished, metrics=request.metrics,
                             num_cached_tokens=request.num_cached_tokens)


def _delta(s: SampleState, hold_back: int) -> CompletionOutput | None:
    """What is new in sample ``s`` since its previous DELTA output. Until it finishes, the last
    ``output_text_buffer_length`` characters are held back: they may be the start of a stop
    string, which is cut from the text once complete and must never have been shown."""
    if s.sent_final:
        return None
    tokens = s.output_token_ids[s.sent_tokens:]
    text = s.detokenizer.text if s.detokenizer else ""
    text_end = max(len(text) - (0 if s.finish_reason is not None else hold_back), s.sent_text)
    if not tokens and s.finish_reason is None:
        return None
    logprobs = None if s.logprobs is None else s.logprobs[s.sent_logprobs:]
    out = _completion(s, text[s.sent_text:text_end], tokens, logprobs)
    s.sent_tokens, s.sent_text = len(s.output_token_ids), text_end
    s.sent_logprobs = 0 if s.logprobs is None else len(s.logprobs)
    s.sent_final = s.finish_reason is not None
    return out


def _completion(s: SampleState, text: str, token_ids: list[int], logprobs: list | None) -> CompletionOutput:
    return CompletionOutput(index=s.index, text=text, token_ids=token_ids,
                            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                            logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
