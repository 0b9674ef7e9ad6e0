"""Speculative decoding, the engine core's part: vLLM's ``speculative_config``, the drafts each
step proposes, and the acceptance counters behind /metrics.

A decoding request gets draft tokens after each step (prompt lookup: what followed the longest
n-gram that ends its tokens, found earlier in them). The scheduler schedules them after the
request's newest token; the driver worker samples one row per draft plus one and keeps the
drafts its target draws (ops.rejection_sample), then the token after them; the scheduler takes
those tokens and computes the rejected drafts' positions again next step. Output is the same
as without speculation, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

METHODS = ("ngram",)
# Methods vLLM knows that Octavo does not run yet: a clear error rather than an unknown name.
NOT_YET = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` fields that Octavo uses. For ngram, prompt_lookup_min and
    prompt_lookup_max default to each other, or both to 5 (vLLM's defaults)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None  # no drafts while this many requests or more run

    @classmethod
    def from_dict(cls, config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The dict a user passes (LLM(speculative_config=...), --speculative-config), checked;
        None stays None (speculation off)."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        config = dict(config)
        if config.get("model") in ("ngram", "[ngram]") and "method" not in config:
            config["method"] = config.pop("model")  # vLLM's older spelling
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown or unsupported field(s) {unknown}; "
                             f"Octavo takes {sorted(known)}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method in NOT_YET:
            raise ValueError(f"speculative method {self.method!r} is not supported by Octavo yet; use 'ngram'")
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; Octavo supports {list(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass
class SpecDecodingCounts:
    """Running totals since the engine started (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # steps of a request that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position j

    @staticmethod
    def total(counts: list[SpecDecodingCounts | None]) -> SpecDecodingCounts | None:
        """Several engines' counts added up (None where speculation is off)."""
        if any(c is None for c in counts):
            return None
        width = max(len(c.accepted_per_position) for c in counts)
        return SpecDecodingCounts(sum(c.num_drafts for c in counts), sum(c.num_draft_tokens for c in counts),
                                  sum(c.num_accepted_tokens for c in counts),
                                  [sum(c.accepted_per_position[j] for c in counts if j < len(c.accepted_per_position))
                                   for j in range(width)])

    def snapshot(self) -> SpecDecodingCounts:
        return SpecDecodingCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                  list(self.accepted_per_position))


# Beyond vLLM: drafts only where they pay. A step costs about a + b * rows (a: reading the
# weights, b: one row's compute), so k draft rows of one request in a batch of B add b * k to
# a + b * B and pay when their expected accepted tokens E reach k * B / (B + a / b): in a batch,
# a draft row costs about what a request's own row does. Each request keeps an estimate of its
# drafts' acceptance E / k (at first the engine's recent rate, then halfway to each of its
# verifying steps' rates) and drafts while
# it is at least B / (B + STEP_COST_ROWS). Each step it sits out moves the estimate RECOVERY of
# the way back to 1, so a request whose text starts repeating itself drafts again (a rare probe).
# a / b in rows, measured on the default model on 2 CPU cores (bench/RESULTS.md: one step of 1
# token 25.6 ms, of 64 tokens 118 ms); a GPU reads weights far faster than it runs out of
# compute, so its value is larger (not measured yet; vLLM's GPU figures put it in the hundreds).
STEP_COST_ROWS = {"cpu": 16, "cuda": 256}
RECOVERY = 0.02
RECENT_WEIGHT = 0.05


class Speculator:
    """Proposes each step's drafts (the scheduler keeps them for the next step) and counts how
    many the steps accepted."""

    def __init__(self, config: SpeculativeConfig, device_type: str = "cpu"):
        self.config = config
        self.step_cost_rows = STEP_COST_ROWS.get(device_type, STEP_COST_ROWS["cpu"])
        self.counts = SpecDecodingCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self._acceptance: dict[int, float] = {}  # by scheduler handle, while it runs
        self._recent = 1.0  # every request's verifying steps, a moving average: a new request's estimate

    def propose(self, scheduler, handles: list[int], grammars=None) -> None:
        """Drafts for the requests that just sampled and still run, where they pay (see
        STEP_COST_ROWS); none while the batch is at disable_by_batch_size or beyond. A
        constrained request's drafts stop before the first token its grammar refuses, so that
        every row verified has a mask."""
        c = self.config
        if c.disable_by_batch_size and scheduler.num_running >= c.disable_by_batch_size:
            return
        handles = self._worth_drafting(handles, scheduler.num_running)
        if not handles:
            return
        offsets, tokens = scheduler.propose_ngram(handles, c.prompt_lookup_min, c.prompt_lookup_max,
                                                  c.num_speculative_tokens)
        if grammars is not None:
            offsets, tokens = _cut_to_grammars(grammars, handles, offsets, tokens)
        scheduler.set_draft_tokens(handles, offsets, tokens)

    def _worth_drafting(self, handles: list[int], batch: int) -> list[int]:
        needed = batch / (batch + self.step_cost_rows)
        chosen = []
        for handle in handles:
            estimate = self._acceptance.setdefault(handle, self._recent)
            if estimate >= needed:
                chosen.append(handle)
            else:
                self._acceptance[handle] = estimate + (1.0 - estimate) * RECOVERY
        return chosen

    def forget(self, handle: int) -> None:
        self._acceptance.pop(handle, None)

    def record(self, handles: list[int], num_drafts: np.ndarray, num_new_tokens: np.ndarray) -> None:
        """One step: each request's drafts verified and tokens it got from the sampler (its
        accepted drafts + 1)."""
        c = self.counts
        for handle, k, n in zip(handles, num_drafts.tolist(), num_new_tokens.tolist()):
            if k == 0:
                continue
            accepted = min(max(n - 1, 0), k)
            self._acceptance[handle] = (self._acceptance.get(handle, self._recent) + accepted / k) / 2
            self._recent += (accepted / k - self._recent) * RECENT_WEIGHT
            c.num_drafts += 1
            c.num_draft_tokens += k
            c.num_accepted_tokens += accepted
            for j in range(accepted):
                c.accepted_per_position[j] += 1


def _cut_to_grammars(grammars, handles: list[int], offsets: list[int], tokens: list[int]):
    """Each constrained request's drafts up to the first its grammar would refuse."""
    kept, new_offsets = [], [0]
    for i, handle in enumerate(handles):
        draft = tokens[offsets[i]:offsets[i + 1]]
        if handle in grammars:
            draft = draft[:grammars.num_valid_draft_tokens(handle, draft)]
        kept += draft
        new_offsets.append(len(kept))
    return new_offsets, kept
