"""Custom logits processors through vLLM v1's interface (``vllm.v1.sample.logits_processor``):
a class given at engine construction, ``LLM(logits_processors=[MyProcessor])`` or
``"package.module:MyProcessor"`` (``octavo serve --logits-processors ...``), instantiated once in
the sampling worker, sees every step's logits and the batch's changes; requests steer it through
``SamplingParams.extra_args`` (the server's ``vllm_xargs`` field).

The batch is the step's requests, each at a persistent index as in vLLM's input batch: a new
request takes the lowest free index, a request not in the step leaves its index, and the batch is
then condensed (the highest indices move down into the holes). ``update_state`` gets those
changes (None when there are none) before ``apply`` gets the logits in index order.

Octavo runs the processors on the logits before its sampling op, so they come before logit_bias,
the penalties and temperature (vLLM runs argmax-invariant ones after temperature); processors
that declare themselves argmax-invariant are skipped when every request of the step is greedy,
as in vLLM. Returned logprobs are those of the processed logits.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from types import SimpleNamespace
from typing import Any

import torch


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at i1 moves to i2; i1 is left empty
    SWAP = auto()  # the requests at i1 and i2 trade places (Octavo's condensing never swaps)


@dataclass(frozen=True)
class BatchUpdate:
    """The batch's changes since the last step, to apply in the order removed, added, moved.
    added: (index, SamplingParams, prompt token ids, output token ids): the output list is the
    request's own, which grows as it generates."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple[int, Any, list[int] | None, list[int]]]
    moved: Sequence[tuple[int, int, MoveDirectionality]]


class LogitsProcessor(ABC):
    """vLLM v1's logits processor. ``config`` stands for vLLM's VllmConfig: it has
    ``model_config.vocab_size`` and ``scheduler_config.max_num_seqs``."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raises ValueError for a request this processor cannot serve (checked when it is added)."""

    @abstractmethod
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [batch_size, vocab] float32 in index order; may change them in place."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token is the most likely."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise NotImplementedError


def resolve(processors: Sequence[type | str] | None) -> list[type]:
    """Classes, or "module.path:ClassName" / "module.path.ClassName" strings, as classes."""
    classes = []
    for p in processors or []:
        if isinstance(p, str):
            module, sep, name = p.partition(":") if ":" in p else p.rpartition(".")
            try:
                p = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"logits processor {p!r} cannot be imported: {e}") from None
        if not (isinstance(p, type) and issubclass(p, LogitsProcessor)):
            raise ValueError(f"a logits processor must be a LogitsProcessor subclass, got {p!r}")
        classes.append(p)
    return classes


def engine_config(vocab_size: int, max_num_seqs: int) -> SimpleNamespace:
    """What a processor's constructor gets for vLLM's VllmConfig."""
    return SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab_size),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


class LogitsProcessors:
    """The sampling worker's processors and the persistent batch they see."""

    def __init__(self, classes: list[type], vocab_size: int, max_num_seqs: int, device: torch.device):
        config = engine_config(vocab_size, max_num_seqs)
        self.processors = [cls(config, device, device.type == "cuda") for cls in classes]
        self.slots: list[int | None] = []  # handle at each batch index

    def apply(self, logits: torch.Tensor, handles: list[int], states: list) -> None:
        """Runs every processor on the step's logits (rows in step order, changed in place)."""
        update = self._update(handles, states)
        for p in self.processors:
            p.update_state(update)
        greedy = all(s.params.temperature < 1e-5 for s in states)
        active = [p for p in self.processors if not (greedy and p.is_argmax_invariant())]
        if not active:
            return
        row = {h: i for i, h in enumerate(handles)}
        order = torch.tensor([row[h] for h in self.slots], dtype=torch.int64, device=logits.device)
        batch = logits.index_select(0, order)
        for p in active:
            batch = p.apply(batch)
        logits.index_copy_(0, order, batch)

    def _update(self, handles: list[int], states: list) -> BatchUpdate | None:
        here = set(handles)
        removed = [i for i, h in enumerate(self.slots) if h is not None and h not in here]
        for i in removed:
            self.slots[i] = None
        known = {h for h in self.slots if h is not None}
        added = []
        for h, s in zip(handles, states):
            if h in known:
                continue
            index = self.slots.index(None) if None in self.slots else len(self.slots)
            self.slots[index:index + 1] = [h]
            added.append((index, s.params, s.prompt_token_ids, s.output_token_ids))
        moved = self._condense()
        if not (removed or added or moved):
            return None
        return BatchUpdate(len(handles), removed, added, moved)

    def _condense(self) -> list[tuple[int, int, MoveDirectionality]]:
        """Moves the highest occupied indices into the lowest holes until the batch is dense."""
        moved = []
        while None in self.slots:
            hole = self.slots.index(None)
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            if hole >= len(self.slots):
                break
            last = len(self.slots) - 1
            self.slots[hole] = self.slots.pop()
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        return moved
