"""Per-step sampling inputs built from the requests' parameters, and one call to ``ops.sample``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import _C


@dataclass
class SamplingState:
    """What the sampler needs of one running request. ``params`` is a SamplingParams."""

    params: object
    prompt_token_ids: list[int]
    seed: int
    stop_token_ids: list[int] = field(default_factory=list)  # EOS (unless ignored) + the request's own
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: np.ndarray                        # [R] int32
    logprobs: np.ndarray | None = None           # [R] float32, raw logprob of the sampled token
    ranks: np.ndarray | None = None              # [R] int32
    top_token_ids: np.ndarray | None = None      # [R, n] int32
    top_logprobs: np.ndarray | None = None       # [R, n] float32


def _csr(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    flat = np.fromiter((t for x in lists for t in x), dtype=np.int32, count=int(offsets[-1]))
    return torch.from_numpy(offsets), torch.from_numpy(flat)


def _column(states, name: str, dtype) -> torch.Tensor:
    return torch.tensor([getattr(s.params, name) for s in states], dtype=dtype)


def sample(logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
    """logits: float32 [R, vocab] in batch order; states: the same R requests."""
    n = len(states)
    kwargs = dict(top_k=_column(states, "top_k", torch.int32), top_p=_column(states, "top_p", torch.float32),
                  min_p=_column(states, "min_p", torch.float32))
    rep, freq, pres = (_column(states, k, torch.float32)
                       for k in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    if (rep != 1).any() or (freq != 0).any() or (pres != 0).any():
        kwargs.update(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        kwargs["prompt_offsets"], kwargs["prompt_token_ids"] = _csr([s.prompt_token_ids for s in states])
        kwargs["output_offsets"], kwargs["output_token_ids"] = _csr([s.output_token_ids for s in states])
    # min_tokens: stop tokens cannot be sampled until the request has that many outputs.
    banned = [s.stop_token_ids if len(s.output_token_ids) < s.params.min_tokens else [] for s in states]
    if any(banned):
        kwargs["banned_offsets"], kwargs["banned_token_ids"] = _csr(banned)
    num_top = max((s.params.logprobs or 0) for s in states)
    wants_logprobs = any(s.params.logprobs is not None for s in states)
    out = SamplerOutput(token_ids=np.empty(n, dtype=np.int32))
    if wants_logprobs:
        out.logprobs, out.ranks = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.int32)
        kwargs.update(sampled_logprobs=torch.from_numpy(out.logprobs), sampled_ranks=torch.from_numpy(out.ranks))
        if num_top:
            out.top_token_ids = np.empty((n, num_top), dtype=np.int32)
            out.top_logprobs = np.empty((n, num_top), dtype=np.float32)
            kwargs.update(top_token_ids=torch.from_numpy(out.top_token_ids),
                          top_logprobs=torch.from_numpy(out.top_logprobs))
    _C.ops.sample(logits, _column(states, "temperature", torch.float32),
                  torch.tensor([s.seed for s in states], dtype=torch.int64),
                  torch.tensor([len(s.output_token_ids) for s in states], dtype=torch.int64),
                  torch.from_numpy(out.token_ids), **kwargs)
    return out
