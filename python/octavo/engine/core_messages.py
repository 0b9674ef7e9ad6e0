"""What crosses between the front end (LLMEngine, AsyncLLM) and the engine core: requests in,
each step's outputs back. Plain data, so that the core can run in a process of its own.

One core request is one sample: a request with n > 1 is n core requests "<id>#<i>"; the front
end gathers their outputs into one RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import FINISH_REASONS
from ..config import ModelConfig
from ..executor.step_io import PromptLogprobs, SamplerOutput
from ..sampling_params import SamplingParams
from ..speculative import SpecDecodingCounts


class EngineDeadError(RuntimeError):
    """The engine has stopped: shut down, or its core process died."""


@dataclass
class EngineCoreRequest:
    request_id: str  # "<request id>#<sample index>"
    prompt_token_ids: list[int]
    params: SamplingParams  # checked and completed by the front end (max_tokens set)
    seed: int
    eos_token_id: int  # -1: none
    stop_token_ids: list[int]  # the request's own and the model's other EOS ids
    priority: int = 0
    wants_prompt_logprobs: bool = False  # this sample records them (it skips reading the prefix cache)


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's and block pool's state after a step (for /metrics and tests)."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decoding: SpecDecodingCounts | None = None  # speculative decoding's running totals (None: off)


# EngineCoreOutputs.finish_reasons codes: the scheduler's (FINISH_REASONS), then the engine's own.
ERROR = 4
FINISH_REASON_NAMES = (*FINISH_REASONS, "error")


@dataclass
class EngineCoreOutputs:
    """What a step did to its requests, one row each, in batch order (columns, so that a step
    of hundreds of requests encodes in microseconds)."""

    request_ids: list[str]  # [N]
    new_token_offsets: np.ndarray  # [N + 1] int32: row i's new tokens are new_token_ids[o[i]:o[i + 1]]
    new_token_ids: np.ndarray  # int32
    finish_reasons: np.ndarray  # [N] int8: 0 running, else FINISH_REASON_NAMES's index
    stop_reasons: np.ndarray  # [N] int32: the stop token that ended it, or -1
    num_cached_tokens: np.ndarray  # [N] int32: prompt tokens found in the prefix cache when first scheduled, or -1
    sampled: SamplerOutput | None = None  # the sampler's arrays, same rows (logprobs of the new tokens)
    prompt_logprobs: list[tuple[int, int, PromptLogprobs]] = field(default_factory=list)  # (row, first, chunk)
    stats: SchedulerStats = SchedulerStats()

    @classmethod
    def empty(cls, stats: SchedulerStats) -> EngineCoreOutputs:
        none = np.zeros(0, dtype=np.int32)
        return cls([], np.zeros(1, dtype=np.int32), none, none.astype(np.int8), none, none, stats=stats)


@dataclass
class EngineCoreInfo:
    """What the front end learns from the core at startup."""

    model_config: ModelConfig
    model_dtype: str
    device: str
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    kv_block_bytes: int
    scheduling_policy: str
    kv_group_windows: list[int]  # the scheduler's (kv_groups.py): empty for one group
    max_step_tokens: int  # tokens one step computes at most (max_num_batched_tokens)
