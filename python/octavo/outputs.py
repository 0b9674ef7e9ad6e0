"""What ``LLM.generate`` returns: the same classes and field names as ``vllm.outputs``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Logprob:
    """Log probability of one candidate token (OpenAI-compatible logprobs).

    Attributes:
        logprob: log probability of the token.
        rank: its rank in the vocabulary distribution (1 = most likely), when known.
        decoded_token: the token's text, when detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per output position: {token_id: Logprob} for the sampled token and the top-k candidates.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first entry is None (the first prompt token has no prediction).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds, ``time.time()`` clock).

    Attributes:
        arrival_time: when the request arrived.
        last_token_time: when its latest token was produced.
        first_scheduled_time: when it was first scheduled.
        first_token_time: when its first output token was produced.
        time_in_queue: first_scheduled_time - arrival_time.
        finished_time: when it finished.
        scheduler_time: time spent in the scheduler on its behalf.
        model_forward_time: time in model forward passes it took part in.
        model_execute_time: time in model execution (forward, sampling, syncs) it took part in.
    """

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: position of this output among the request's n outputs.
        text: the generated text.
        token_ids: the generated token ids.
        cumulative_logprob: sum of the sampled tokens' log probabilities (None if not computed).
        logprobs: per-token top log probabilities, when requested.
        finish_reason: "stop", "length" or "abort" once finished, else None.
        stop_reason: the stop string or stop token id that ended the output; None when it ended
            for another reason, including the EOS token.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


class RequestOutput:
    """The output of one request to the LLM.

    Attributes:
        request_id: the request's unique id.
        prompt: the prompt string (None when the prompt was given as token ids).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token log probabilities, when requested.
        outputs: the generated sequences, one per ``SamplingParams.n``.
        finished: whether the whole request is finished.
        metrics: timing of the request.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics | None = None,
        num_cached_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.num_cached_tokens = num_cached_tokens

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merges a later output of the same request into this one.

        With ``aggregate`` the later output is a delta (RequestOutputKind.DELTA) and is appended;
        without it, it is cumulative and replaces the output with the same index.
        """
        self.finished |= next_output.finished
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        for new in next_output.outputs:
            for i, old in enumerate(self.outputs):
                if old.index != new.index:
                    continue
                if aggregate:
                    old.text += new.text
                    old.token_ids = [*old.token_ids, *new.token_ids]
                    if new.logprobs:
                        old.logprobs = [*(old.logprobs or []), *new.logprobs]
                    old.cumulative_logprob = new.cumulative_logprob
                    old.finish_reason = new.finish_reason
                    old.stop_reason = new.stop_reason
                else:
                    self.outputs[i] = new
                break
            else:
                self.outputs.append(new)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )
