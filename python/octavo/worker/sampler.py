"""Per-step sampling inputs built from the requests' parameters, and one call to ``ops.sample``
(or, in a step verifying draft tokens, ``ops.rejection_sample``)."""

from __future__ import annotations

import copy
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

    def after(self, drafts: list[int]) -> SamplingState:
        """The state at the row after these draft tokens (speculative decoding): as if they had
        been generated, for the penalties, bans and the draw's counter."""
        row = copy.copy(self)
        row.output_token_ids = self.output_token_ids + drafts
        return row


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


def sample(logits: torch.Tensor, states: list[SamplingState], staging: Staging | None = None,
           drafts: list[list[int]] | None = None) -> SamplerOutput:
    """logits: float32 [R, vocab] in batch order, on the CPU or a GPU; states: the same R requests.
    Sampling runs where the logits are; the results come back as NumPy arrays. The per-request
    inputs are built on the host and moved in one copy through ``staging`` (a new one if None).
    With ``drafts`` (each request's draft tokens, speculative decoding) logits has one row per
    draft plus one for each request, in order, and each request gets its accepted drafts and the
    token after them (SamplerOutput.offsets)."""
    if drafts is not None:
        return _verify(logits, states, drafts, staging)
    return _sample_rows(logits, states, staging)[0]


def _verify(logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]],
            staging: Staging | None) -> SamplerOutput:
    """Row j of a request with drafts d checks d[j] with the state after d[:j]; its last row
    has no draft. A request keeps its rows up to its first one not accepted."""
    rows = [state.after(draft[:j]) if j else state for state, draft in zip(states, drafts)
            for j in range(len(draft) + 1)]
    checked = np.array([t for draft in drafts for t in [*draft, -1]], dtype=np.int32)
    out, accepted = _sample_rows(logits, rows, staging, checked)
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
    kept = [np.arange(start, start + 1 + _leading_ones(accepted[start:end]))
            for start, end in zip(starts[:-1], starts[1:])]
    out = SamplerOutput(**{name: None if (v := getattr(out, name)) is None else v[np.concatenate(kept)]
                           for name in SamplerOutput.__dataclass_fields__ if name != "offsets"})
    out.offsets = np.cumsum([0] + [len(k) for k in kept]).astype(np.int32)
    return out


def _leading_ones(flags: np.ndarray) -> int:
    zeros = np.flatnonzero(flags == 0)
    return int(zeros[0]) if len(zeros) else len(flags)


def _sample_rows(logits: torch.Tensor, states: list[SamplingState], staging: Staging | None,
                 drafts: np.ndarray | None = None) -> tuple[SamplerOutput, np.ndarray | None]:
    """One row per state: ops.sample, or ops.rejection_sample checking each row's draft (then
    also its accepted flag per row)."""
    n, device = len(states), logits.device
    vocab = logits.shape[-1]
    inputs = dict(temperature=_column(states, "temperature", np.float32, 0.0, _MAX_FACTOR),
                  **({} if drafts is None else {"drafts": drafts}),
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
    checked = kwargs.pop("drafts", None)
    num_top = max(vocab if s.params.logprobs == -1 else (s.params.logprobs or 0) for s in states)
    specs = {"token_ids": ((n,), torch.int32)}
    if checked is not None:
        specs["accepted"] = ((n,), torch.int32)
    if any(s.params.logprobs is not None for s in states):
        specs.update(logprobs=((n,), torch.float32), ranks=((n,), torch.int32))
        if num_top:
            specs.update(top_token_ids=((n, num_top), torch.int32), top_logprobs=((n, num_top), torch.float32))
    outputs = PackedOutputs(device, **specs)  # one copy back, however many outputs
    out = outputs.tensors
    kwargs.update({arg: out[name] for arg, name in (("sampled_logprobs", "logprobs"), ("sampled_ranks", "ranks"),
                                                    ("top_token_ids", "top_token_ids"),
                                                    ("top_logprobs", "top_logprobs")) if name in out})
    if checked is None:
        _C.ops.sample(logits, temperature, seeds, counters, out["token_ids"], **kwargs)
    else:
        _C.ops.rejection_sample(logits, temperature, seeds, counters, out["token_ids"], checked, out["accepted"],
                                **kwargs)
    host = outputs.to_host()
    accepted = host.pop("accepted", None)
    return SamplerOutput(**host), accepted


def join_requests(outputs: list[SamplerOutput | None], with_offsets: bool) -> SamplerOutput:
    """Requests sampled one by one, joined in order; a request whose sampling failed (None)
    gets token 0 and zero logprobs (it is being aborted). ``with_offsets``: each request may
    have several tokens (a step verifying drafts)."""
    done = next((o for o in outputs if o is not None), None)
    counts = [1 if o is None or o.offsets is None else int(o.offsets[-1]) for o in outputs]

    def join(name: str) -> np.ndarray | None:
        if done is None or getattr(done, name) is None:
            return None
        like = getattr(done, name)
        return np.concatenate([getattr(o, name) if o is not None else np.zeros((1, *like.shape[1:]), like.dtype)
                               for o in outputs])

    if done is None:
        joined = SamplerOutput(token_ids=np.zeros(len(outputs), dtype=np.int32))
    else:
        joined = SamplerOutput(**{name: join(name) for name in SamplerOutput.__dataclass_fields__
                                  if name != "offsets"})
    if with_offsets:
        joined.offsets = np.cumsum([0] + counts).astype(np.int32)
    return joined
