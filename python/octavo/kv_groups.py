"""KV cache groups of hybrid models (vLLM v1's KV cache groups).

A model whose layers mix full and sliding-window attention keeps, for its sliding layers, only
the KV their window can still reach. Its attention layers form groups of one kind and equal
size; group j's i-th layer shares KV tensor i with every other group's i-th layer, so a block
id means one block of bytes whatever group holds it and every group draws on one pool. The
scheduler keeps a block table per group and frees what a sliding group's window left behind
(include/octavo/kv_cache_manager.h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]             # [G] each group's sliding window in tokens, 0: full; group 0 is full
    layers: tuple[tuple[int, ...], ...]  # [G][size] each group's layers, as indices into attention_layers()

    @property
    def size(self) -> int:
        """Layers per group: the KV tensors (K and V each) the cache has."""
        return len(self.layers[0])

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1

    def scheduler_windows(self) -> list[int]:
        """SchedulerConfig's kv_group_windows: empty for one group."""
        return list(self.windows) if self.hybrid else []

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request of num_tokens tokens holds in all groups while its newest token is
        computed: a sliding group only those from that token's window on."""
        blocks = -(-num_tokens // block_size)
        return sum(blocks - (max(0, num_tokens - w) // block_size if w else 0) for w in self.windows)

    def kv_fraction(self, num_tokens: int, block_size: int) -> float:
        """KV a request of num_tokens tokens holds, as a fraction of full attention on every layer."""
        return self.blocks_held(num_tokens, block_size) / (len(self.windows) * -(-num_tokens // block_size))

    def describe(self) -> str:
        sliding = sorted({w for w in self.windows if w})
        kinds = [f"{self.windows.count(0)} full"] + [f"{self.windows.count(w)} sliding (window {w})" for w in sliding]
        return f"{' + '.join(kinds)} group(s) of {self.size} layer(s)"


def plan_kv_groups(windows: list[int]) -> KVGroups:
    """Groups for attention layers with these sliding windows (0: full attention). One group of
    every layer when they are all of one kind, or when no layer has full attention (group 0
    anchors prefix-cache hits). Else the group size is the greatest common divisor of the kinds'
    layer counts, so that every group is full (Gemma 3 270M: 3 full and 15 sliding layers make
    6 groups of 3)."""
    kinds = sorted(set(windows))
    if len(kinds) <= 1 or kinds[0] != 0:
        return KVGroups((0,), (tuple(range(len(windows))),))
    size = math.gcd(*(windows.count(w) for w in kinds))
    groups = []
    for w in kinds:
        members = [i for i, x in enumerate(windows) if x == w]
        groups += [(w, tuple(members[j:j + size])) for j in range(0, len(members), size)]
    return KVGroups(tuple(w for w, _ in groups), tuple(layers for _, layers in groups))


def model_kv_groups(model) -> KVGroups:
    """The groups of a loaded model's attention layers. A pipeline stage holds only some layers
    and groups would span stages, so stages keep one group."""
    windows = [attn.sliding_window for attn in model.attention_layers()]
    if getattr(model, "stage", None) is not None and model.stage.world > 1:
        return plan_kv_groups([0] * len(windows))
    return plan_kv_groups(windows)
