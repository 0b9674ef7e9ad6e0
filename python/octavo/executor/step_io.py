"""What crosses the executor seam each step: one StepInput to the workers, one StepOutput back.

A step's input is the scheduler's flat arrays (token ids, positions, KV slots, block tables),
plus the sampling parameters of the requests the workers have not seen yet, the handles they
may forget, and the prompt-logprob rows wanted. Workers keep each request's sampling state
(parameters, seed, the tokens it generated) from its first step to its last, so a continuing
request costs nothing beyond its row in the arrays. Everything here is plain data (NumPy arrays,
lists, dataclasses), so that it can be sent to another process as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling_params import SamplingParams

# The scheduler's arrays a forward pass reads, in SchedulerOutput's names.
STEP_ARRAYS = ("req_handles", "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
               "block_table", "logits_indices", "block_copies", "num_draft_tokens", "group_block_tables",
               "group_slot_mappings")


@dataclass
class NewRequest:
    """A request's sampling state, sent with the first step that schedules it."""

    handle: int  # the scheduler's
    params: SamplingParams
    prompt_token_ids: list[int]
    seed: int
    stop_token_ids: list[int]  # banned until min_tokens: EOS (unless ignored) and the request's own


@dataclass
class StepInput:
    """One scheduler step for the workers. The arrays may be views of the scheduler's buffers,
    valid until its next step (the in-process executor reads them there; others copy)."""

    req_handles: np.ndarray     # [R] int64, batch order
    input_ids: np.ndarray       # [T] int32
    positions: np.ndarray       # [T] int32
    slot_mapping: np.ndarray    # [T] int32
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray        # [R] int32
    block_table: np.ndarray     # [R, width] int32
    logits_indices: np.ndarray  # [R + D] int32, sampled rows: num_draft_tokens[i] + 1 per request
    block_copies: np.ndarray    # [2C] int32 (src, dst) KV block pairs, copied before the forward pass
    num_draft_tokens: np.ndarray  # [R] int32, draft tokens each request verifies (its last ones)
    # Hybrid models (kv_groups.py): KV groups 1, 2, ...'s block tables and slot mappings; the
    # arrays above are group 0's. [0, R, width] and [0, T] with one group.
    group_block_tables: np.ndarray   # [G - 1, R, width] int32
    group_slot_mappings: np.ndarray  # [G - 1, T] int32
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_handles: list[int] = field(default_factory=list)  # finished or aborted: workers forget them
    # [C, 4] int32, one row per prompt chunk whose logprobs are wanted: (batch index i, first,
    # last, k): the chunk's flat rows query_start_loc[i] .. + (last - first) predict prompt tokens
    # first + 1 .. last; k top tokens each (-1: the whole vocabulary).
    prompt_logprobs: np.ndarray | None = None
    # Structured output: [G, ceil(vocab / 32)] int32 token masks (bit set = allowed) for the
    # logits rows grammar_rows [G] int32, applied to their logits before sampling.
    grammar_bitmask: np.ndarray | None = None
    grammar_rows: np.ndarray | None = None
    # Speculative decoding with a draft model: the batch rows to draft for after this step, and
    # the requests this step's schedule preempted (their KV went back to the pool).
    draft_rows: list[int] = field(default_factory=list)
    preempted_handles: list[int] = field(default_factory=list)

    @classmethod
    def from_scheduler(cls, out, copy: bool = False, **extra) -> StepInput:
        """The scheduler output's arrays: views of its buffers, or copies (``copy``)."""
        take = np.array if copy else (lambda a: a)
        return cls(**{name: take(getattr(out, name)) for name in STEP_ARRAYS}, **extra)

    @property
    def num_reqs(self) -> int:
        return len(self.req_handles)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return len(self.input_ids)

    def drafts(self) -> list[list[int]] | None:
        """Each request's draft tokens (the last num_draft_tokens[i] of its scheduled tokens), or
        None in a step that verifies none."""
        if not self.num_draft_tokens.any():
            return None
        ends = self.query_start_loc[1:].tolist()
        return [self.input_ids[end - k:end].tolist() for end, k in zip(ends, self.num_draft_tokens.tolist())]


@dataclass
class PromptLogprobs:
    """One prompt chunk's logprobs (StepInput.prompt_logprobs row), L = last - first."""

    logprobs: np.ndarray      # [L] float32, of each prompt token
    ranks: np.ndarray         # [L] int32
    top_token_ids: np.ndarray  # [L, k] int32
    top_logprobs: np.ndarray   # [L, k] float32


@dataclass
class RowFailure:
    """A row whose sampling failed (its token is 0 and its request is to be aborted)."""

    row: int
    error: str  # the exception with its traceback, as text (it may come from another process)


@dataclass
class SamplerOutput:
    """The sampler's results for a step's rows, in batch order: one token per request, or with
    ``offsets`` (a step verifying drafts) request i's tokens at [offsets[i], offsets[i + 1])."""

    token_ids: np.ndarray                        # [R] int32
    logprobs: np.ndarray | None = None           # [R] float32, raw logprob of the sampled token
    ranks: np.ndarray | None = None              # [R] int32
    top_token_ids: np.ndarray | None = None      # [R, n] int32
    top_logprobs: np.ndarray | None = None       # [R, n] float32
    offsets: np.ndarray | None = None            # [R + 1] int32, or None: one token per request

    def per_request(self) -> list[list[int]]:
        """Each request's tokens."""
        tokens = self.token_ids.tolist()
        if self.offsets is None:
            return [[t] for t in tokens]
        offsets = self.offsets.tolist()
        return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@dataclass
class StepTimes:
    """How long the driver's parts of a step took, for the speculative cost rule."""

    rows: int              # token rows of the forward pass
    model_seconds: float   # the forward pass and sampling
    drafted: int = 0       # requests the drafter drafted for
    draft_seconds: float = 0.0  # their drafting (not an EAGLE head's catch-up, which runs anyway)


@dataclass
class StepOutput:
    """What the workers made of a step (rank 0's results)."""

    sampled: SamplerOutput
    failures: list[RowFailure] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # in StepInput.prompt_logprobs order
    # A draft model's proposals for the step's requests' next step: request i's drafts are
    # draft_token_ids[draft_offsets[i]:draft_offsets[i + 1]] (int32; None without a draft model).
    draft_offsets: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None
    times: StepTimes | None = None  # with a drafting model, unless the step's times say nothing
