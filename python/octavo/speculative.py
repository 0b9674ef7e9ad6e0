"""Speculative decoding, the engine core's part: vLLM's ``speculative_config``, the drafts each
step proposes, and the acceptance counters behind /metrics.

A decoding request gets draft tokens after each step: by prompt lookup ("ngram": what followed
the longest n-gram that ends its tokens, found earlier in them), or from a smaller draft model
that the driver worker runs after each step ("draft_model", worker/draft_model.py), or from an
EAGLE head on the target's hidden states ("eagle", "eagle3", worker/eagle.py); both draft
greedily, so their drafts are deterministic as the verification assumes. The scheduler
schedules them after the request's newest token; the driver worker samples one row per draft
plus one and keeps the drafts its target draws (ops.rejection_sample), then the token after them; the scheduler takes
those tokens and computes the rejected drafts' positions again next step. Output is the same
as without speculation, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

EAGLE_METHODS = ("eagle", "eagle3")
METHODS = ("ngram", "draft_model", *EAGLE_METHODS)
MODEL_METHODS = ("draft_model", *EAGLE_METHODS)  # a model drafts, run by the driver worker
# Methods vLLM knows that Octavo does not run yet: a clear error rather than an unknown name.
NOT_YET = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
QUANTIZATIONS = ("int8", "int4", "q4_1", "w4a8", "w8a8", "fp8", "gguf_a8")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` fields that Octavo uses. For ngram, prompt_lookup_min and
    prompt_lookup_max default to each other, or both to 5 (vLLM's defaults). A ``model`` without
    a method is a draft model; ``quantization`` quantizes it at load (the target's own weights
    in int4 make a self-draft)."""

    num_speculative_tokens: int
    method: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None  # no drafts while this many requests or more run
    model: str | None = None  # the draft model's directory (draft_model)
    quantization: str | None = None  # the draft model's: int8 / int4 / q4_1 / w4a8 / w8a8 / fp8, rounded at load

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
        if self.method is None:
            self.method = "ngram" if self.model is None else "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method in NOT_YET:
            raise ValueError(f"speculative method {self.method!r} is not supported by Octavo yet; "
                             f"use one of {list(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; Octavo supports {list(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)
        if self.method in MODEL_METHODS:
            self._check_draft_model()
        else:
            self._check_ngram()

    def _check_draft_model(self) -> None:
        if not self.model:
            what = "draft model's" if self.method == "draft_model" else "EAGLE head's"
            raise ValueError(f"speculative method {self.method!r} needs the {what} directory in 'model'")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError(f"quantization applies to a draft model, not to method {self.method!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min / prompt_lookup_max belong to the 'ngram' method")

    def _check_ngram(self) -> None:
        if self.model is not None or self.quantization is not None:
            raise ValueError("the 'ngram' method takes no 'model' or 'quantization'")
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

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its verified tokens: a draft model writes its KV for
        the token after them and its drafts but the last; an EAGLE head, which reads the token
        after each position, for its drafts but the last."""
        k = self.num_speculative_tokens
        return k if self.method == "draft_model" else k - 1 if self.method in EAGLE_METHODS else 0


def matmul_weights(config) -> int:
    """The weights one token multiplies through in a dense model (a ModelConfig): a row's
    compute, up to a factor."""
    h = config.hidden_size
    attention = h * config.head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    return config.num_hidden_layers * (attention + 3 * h * config.intermediate_size) + h * config.vocab_size


def draft_cost(config: SpeculativeConfig, target) -> float:
    """A draft token's weights over a target token's (ModelConfigs; 0 for ngram). An EAGLE head's
    own layers plus its fc and LM head (EAGLE-3's over its draft vocabulary)."""
    from .config import ModelConfig

    if config.method not in MODEL_METHODS:
        return 0.0
    draft = ModelConfig.from_pretrained(config.model)
    weights = matmul_weights(draft)
    if config.method != "draft_model":
        h, vocab = draft.hidden_size, draft.vocab_size
        target_h = draft.hf.get("target_hidden_size") or target.hidden_size
        fc_inputs = 3 * target_h if config.method == "eagle3" else 2 * h
        weights += h * fc_inputs - h * (vocab - (draft.hf.get("draft_vocab_size") or vocab))
    return weights / matmul_weights(target)


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
# a draft row costs about what a request's own row does. A draft model adds rows of its own,
# about k per drafting request at draft_cost each (its weights per token / the target's), so
# its drafts pay when E reaches k * (1 + draft_cost) * B / (B + a / b). Each request keeps an
# estimate of its drafts' acceptance E / k (at first the engine's recent rate, then halfway to
# each of its verifying steps' rates) and drafts while it is at least (1 + draft_cost) * B /
# (B + a / b). Each step it sits out moves its estimate back towards 1, so a request whose text
# starts repeating itself drafts again (a probe). Probes that fail cost k rows and, with a
# drafting model, the drafting for one request; the estimate recovers at the rate that holds a
# useless drafter's probes to PROBE_OVERHEAD of the request's share of the steps (recovery()).
# a / b is measured at startup (worker/step_costs.py: steps of 1 and of 64 one-token requests,
# 1024 on a GPU), and so is a drafter's time for 1 and for up to 16 drafting requests.
# STEP_COST_ROWS holds the values the rule starts from where nothing was measured: the default
# model's on 2 CPU cores (bench/RESULTS.md: one step of 1 token 25.6 ms, of 64 tokens 118 ms),
# and for a GPU a guess (it reads weights far faster than it runs out of compute).
# A model drafter's cost is measured (DraftCost): the k drafts of B requests pay when their
# acceptance reaches (B + D / k) / (B + a / b), D being the drafting's time in target rows, fixed
# costs (weight reads, Python) included: from the startup times, then from the steps' own.
STEP_COST_ROWS = {"cpu": 16, "cuda": 256}
PROBE_OVERHEAD = 0.03
RECENT_WEIGHT = 0.05


class DraftCost:
    """A drafting model's time per step in target rows (one row: a step's time / (a / b + its
    rows)) for n drafting requests, fitted as c0 + c1 * n over the recent steps and the startup
    times."""

    DECAY = 0.95  # the weight of a step 14 steps back is half a new one's
    MIN_STEPS = 3

    def __init__(self):
        self._sums = np.zeros(5)  # weighted count, n, rows, n^2, n * rows
        self._prior = np.zeros(5)  # the same sums of the startup times

    def prior(self, points: list[tuple[int, float]]) -> None:
        """Times measured at startup, (n, rows): they weigh as MIN_STEPS steps and never fade, so
        the rule knows the drafting's price from the first step and returns to it when the
        steps' own times have faded."""
        self._prior = sum((np.array([1.0, n, rows, n * n, n * rows]) for n, rows in points), np.zeros(5))
        self._prior *= self.MIN_STEPS / max(len(points), 1)

    def add(self, n: int, rows: float) -> None:
        self._sums = self._sums * self.DECAY + np.array([1.0, n, rows, n * n, n * rows])

    def age(self) -> None:
        """A step without drafting: the fit fades, and some 40 steps after the last drafting the
        rule falls back on the weights' price and measures again (a cost that kept everyone from
        drafting is not final)."""
        self._sums *= self.DECAY

    def rows(self, n: int) -> float | None:
        """The drafting rows for n requests, or None before MIN_STEPS steps."""
        w, x, y, xx, xy = self._sums + self._prior
        if w < self.MIN_STEPS * self.DECAY ** self.MIN_STEPS:
            return None
        mean_x, mean_y = x / w, y / w
        spread = xx / w - mean_x * mean_x
        if spread < 0.25:  # one batch size seen: proportional
            return mean_y * n / mean_x
        slope = (xy / w - mean_x * mean_y) / spread
        return max(mean_y + slope * (n - mean_x), 0.0)


class Speculator:
    """Proposes each step's drafts (the scheduler keeps them for the next step) and counts how
    many the steps accepted."""

    def __init__(self, config: SpeculativeConfig, device_type: str = "cpu", draft_cost: float = 0.0):
        """draft_cost: a draft model's weights per token over the target's (matmul_weights)."""
        self.config = config
        self.step_cost_rows = STEP_COST_ROWS.get(device_type, STEP_COST_ROWS["cpu"])
        self.draft_cost = draft_cost
        self.counts = SpecDecodingCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self.draft_time = DraftCost()
        self._acceptance: dict[int, float] = {}  # by scheduler handle, while it runs
        self._recent = 1.0  # every request's verifying steps, a moving average: a new request's estimate

    def calibrate(self, step_cost_rows: float, drafting: list[tuple[int, float]]) -> None:
        """This machine's prices, measured at startup (worker/step_costs.py): a step's fixed cost
        in rows, and the drafter's time in rows for some numbers of drafting requests."""
        self.step_cost_rows = step_cost_rows
        self.draft_time.prior(drafting)

    def propose(self, scheduler, handles: list[int], grammars=None, drafted: dict | None = None) -> None:
        """Drafts for the requests that just sampled and still run, where they pay (the comment
        above STEP_COST_ROWS); none while the batch is at disable_by_batch_size or beyond. ngram
        drafts them here; a draft model's drafts come in ``drafted`` (by handle). A constrained
        request's drafts stop before the first token its grammar refuses, so that every row
        verified has a mask."""
        c = self.config
        if drafted is None:  # ngram
            handles = [] if self._off(scheduler.num_running) else self._worth_drafting(handles, scheduler.num_running)
        if not handles:
            return
        if drafted is None:
            offsets, tokens = scheduler.propose_ngram(handles, c.prompt_lookup_min, c.prompt_lookup_max,
                                                      c.num_speculative_tokens)
        else:  # a draft model's, for the rows draft_rows chose before the step
            lists = [drafted.get(h, []) for h in handles]
            offsets, tokens = np.cumsum([0] + [len(x) for x in lists]).tolist(), [t for x in lists for t in x]
        if grammars is not None:
            offsets, tokens = _cut_to_grammars(grammars, handles, offsets, tokens)
        scheduler.set_draft_tokens(handles, offsets, tokens)

    def draft_rows(self, handles: list[int], batch: int) -> list[int]:
        """A draft model's: the rows of a step's batch to draft for after it."""
        if self._off(batch):
            return []
        chosen = set(self._worth_drafting(handles, batch))
        return [i for i, h in enumerate(handles) if h in chosen]

    def _off(self, batch: int) -> bool:
        return bool(self.config.disable_by_batch_size) and batch >= self.config.disable_by_batch_size

    def needed(self, batch: int) -> float:
        """The acceptance a request's drafts need in a batch of this size to pay for themselves."""
        measured = self.draft_time.rows(batch)
        if measured is None:
            return (1 + self.draft_cost) * batch / (batch + self.step_cost_rows)
        return (batch + measured / self.config.num_speculative_tokens) / (batch + self.step_cost_rows)

    def record_times(self, times) -> None:
        """A step's StepTimes: its drafting's time, in target rows, for the cost rule."""
        if not times.drafted:
            self.draft_time.age()
            return
        row = times.model_seconds / (self.step_cost_rows + times.rows)
        self.draft_time.add(times.drafted, times.draft_seconds / row)

    def recovery(self, batch: int, needed: float) -> float:
        """The fraction of the way back to 1 a request's estimate moves per step it sits out: the
        rate at which a useless drafter's probes (each a drafting for one request and its k rows,
        leaving the estimate near needed / 2) cost PROBE_OVERHEAD of a request's share of the
        batch's steps ((B + a / b) / B rows)."""
        if not 0 < needed < 1:
            return 0.0
        k, drafting = self.config.num_speculative_tokens, self.draft_time.rows(1)
        if drafting is None:  # unmeasured: k passes of the draft at draft_cost of a target step
            drafting = self.draft_cost * k * (1 + self.step_cost_rows)
        share = (batch + self.step_cost_rows) / batch
        steps = max((k + drafting) / (PROBE_OVERHEAD * share), 1.0)  # between probes
        return 1.0 - ((1.0 - needed) / (1.0 - needed / 2)) ** (1.0 / steps)

    def _worth_drafting(self, handles: list[int], batch: int) -> list[int]:
        needed = self.needed(batch)
        recovery = self.recovery(batch, needed)
        chosen = []
        for handle in handles:
            estimate = self._acceptance.setdefault(handle, self._recent)
            if estimate >= needed:
                chosen.append(handle)
            else:
                self._acceptance[handle] = estimate + (1.0 - estimate) * recovery
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
