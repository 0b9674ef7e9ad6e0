"""Machine and model facts the benchmarks report against: memory bandwidth, weight bytes."""

from __future__ import annotations

import time

import torch


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second that torch's sum reads from a buffer far larger than the caches (best
    of ``repeats``), on torch's threads. Decoding reads weights, so reads are the roofline."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # touched, so no page faults below
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter and buffer once (a tied embedding counts
    once, as the LM head; quantized weights count their blocks), except that an input embedding
    the LM head does not read contributes one row, not the table."""
    seen, total = set(), 0
    for p in [*model.parameters(), *model.buffers()]:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is not None and embed is not head:
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total
