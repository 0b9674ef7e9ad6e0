"""Per-step sampling inputs built from the requests' parameters, and one call to ``ops.sample``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import _C
from ..executor.step_io import SamplerOutput
from .staging import PackedOutputs, Staging


@dataclass
class SamplingState:
    """What the sampler needs of one running request. ``params`` is a SamplingParams."""

    params: object
    prompt_token_ids: list[int]
    seed: int
    stop_token_ids: list[int] = field(default_factory=list)  # EOS (unless ignored) + the request's own
    output_token_ids: list[int] = field(default_factory=list)
    # The request's fixed entries of the bias lists: allowed_token_ids at 0, logit_bias added.
    fixed_biases: dict[int, float] = field(init=False)

    def __post_init__(self) -> None:
        allowed, bias = self.params.allowed_token_ids, self.params.logit_bias or {}
        self.fixed_biases = dict.fromkeys(allowed, 0.0) if allowed is not None else {}
        for token, value in bias.items():
            if allowed is None or token in self.fixed_biases:  # a token allowed_token_ids leaves out stays out
                self.fixed_biases[token] = value

    def biases(self) -> dict[int, float]:
        """This step's bias entries: the fixed ones, then -inf for the stop tokens before min_tokens
        and for each bad word's last token where the output ends with the word's other tokens."""
        entries, out = self.fixed_biases, self.output_token_ids
        banned = list(self.stop_token_ids) if len(out) < self.params.min_tokens else []
        for word in self.params.bad_words_token_ids:
            if len(word) == 1 or (len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]):
                banned.append(word[-1])
        if banned:
            entries = {**entries, **dict.fromkeys(banned, float("-inf"))}
        return entries


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    flat = np.fromiter((t for x in lists for t in x), dtype=np.int32, count=int(offsets[-1]))
    return offsets, flat


def _column(states, name: str, dtype, low=None, high=None) -> np.ndarray:
    """One parameter of every request; ``low`` / ``high`` clamp values that the dtype cannot
    hold as they are (a top_p of 1e-300 is 0 in float32, a top_k of 2**40 overflows int32)."""
    values = [getattr(s.params, name) for s in states]
    if low is not None or high is not None:
        values = [min(max(v, low), high) for v in values]
    return np.array(values, dtype=dtype)


_F32 = np.finfo(np.float32)
# Penalties and temperatures beyond these would turn finite logits into inf or 0 in float32.
_MIN_FACTOR, _MAX_FACTOR = 1e-30, 1e30


def sample(logits: torch.Tensor, states: list[SamplingState], staging: Staging | None = None) -> SamplerOutput:
    """logits: float32 [R, vocab] in batch order, on the CPU or a GPU; states: the same R requests.
    Sampling runs where the logits are; the results come back as NumPy arrays. The per-request
    inputs are built on the host and moved in one copy through ``staging`` (a new one if None)."""
    n, device = len(states), logits.device
    vocab = logits.shape[-1]
    inputs = dict(temperature=_column(states, "temperature", np.float32, 0.0, _MAX_FACTOR),
                  seeds=np.array([s.seed for s in states], dtype=np.int64),
                  counters=np.array([len(s.output_token_ids) for s in states], dtype=np.int64),
                  top_k=_column(states, "top_k", np.int32, -1, vocab),
                  top_p=_column(states, "top_p", np.float32, float(_F32.tiny), 1.0),
                  min_p=_column(states, "min_p", np.float32))
    rep = _column(states, "repetition_penalty", np.float32, _MIN_FACTOR, _MAX_FACTOR)
    freq, pres = (_column(states, k, np.float32) for k in ("frequency_penalty", "presence_penalty"))
    if (rep != 1).any() or (freq != 0).any() or (pres != 0).any():
        inputs.update(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        inputs["prompt_offsets"], inputs["prompt_token_ids"] = _csr([s.prompt_token_ids for s in states])
        inputs["output_offsets"], inputs["output_token_ids"] = _csr([s.output_token_ids for s in states])
    # logit_bias, allowed_token_ids, bad_words and min_tokens: one bias list per request.
    biases = [s.biases() for s in states]
    only_listed = np.array([s.params.allowed_token_ids is not None for s in states], dtype=np.int32)
    if any(biases) or only_listed.any():
        inputs["bias_offsets"], inputs["bias_token_ids"] = _csr([list(b) for b in biases])
        inputs["bias_values"] = np.fromiter((v for b in biases for v in b.values()), dtype=np.float32,
                                            count=int(inputs["bias_offsets"][-1]))
        inputs["only_listed"] = only_listed
    kwargs = dict(zip(inputs, (staging or Staging(device)).to_device(*inputs.values())))
    temperature, seeds, counters = kwargs.pop("temperature"), kwargs.pop("seeds"), kwargs.pop("counters")
    num_top = max(vocab if s.params.logprobs == -1 else (s.params.logprobs or 0) for s in states)
    specs = {"token_ids": ((n,), torch.int32)}
    if any(s.params.logprobs is not None for s in states):
        specs.update(logprobs=((n,), torch.float32), ranks=((n,), torch.int32))
        if num_top:
            specs.update(top_token_ids=((n, num_top), torch.int32), top_logprobs=((n, num_top), torch.float32))
    outputs = PackedOutputs(device, **specs)  # one copy back, however many outputs
    out = outputs.tensors
    kwargs.update({arg: out[name] for arg, name in (("sampled_logprobs", "logprobs"), ("sampled_ranks", "ranks"),
                                                    ("top_token_ids", "top_token_ids"),
                                                    ("top_logprobs", "top_logprobs")) if name in out})
    _C.ops.sample(logits, temperature, seeds, counters, out["token_ids"], **kwargs)
    return SamplerOutput(**outputs.to_host())


def scatter_rows(sampled: SamplerOutput | None, rows: list[int], n: int) -> SamplerOutput:
    """``sampled`` (outputs for ``rows`` of a batch of ``n``) spread back to all n rows; the
    rows left out get token 0 and zero logprobs (their requests are being aborted)."""
    def spread(values: np.ndarray | None) -> np.ndarray | None:
        if values is None:
            return None
        full = np.zeros((n, *values.shape[1:]), dtype=values.dtype)
        full[rows] = values
        return full

    if sampled is None:
        return SamplerOutput(token_ids=np.zeros(n, dtype=np.int32))
    return SamplerOutput(**{name: spread(getattr(sampled, name)) for name in SamplerOutput.__dataclass_fields__})
