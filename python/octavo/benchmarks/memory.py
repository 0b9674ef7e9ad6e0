"""Machine and model facts the benchmarks report against: memory bandwidth, weight bytes."""

from __future__ import annotations

import time

import torch


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second that torch's sum reads from a buffer far larger than the caches (best
    of ``repeats``), on torch's threads or the GPU. Decoding reads weights, so reads are the
    roofline. (On an H100, pass nbytes of several GiB: its L2 is 50 MB.)"""
    device = torch.device(device)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # touched: no page faults below
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        buffer.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter and buffer once (a tied embedding counts
    once, as the LM head; quantized weights count their blocks), except that an input embedding
    the LM head does not read contributes one row, not the table. The RoPE table is not a
    weight: a step reads one row of it per token. A mixture-of-experts layer's expert stacks
    count as the share one token reads (top_k of num_experts): the single-stream roofline."""
    # RoPE tables (Gemma 3 has one per kind of layer) are not weights.
    seen, total = {id(b) for name, b in model.named_buffers() if name.endswith("cos_sin_cache")}, 0
    for p in [*model.parameters(), *model.buffers()]:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is not None and embed is not head and embed.shape[0]:
        total -= _bytes(embed) * (embed.shape[0] - 1) // embed.shape[0]
    for module in model.modules():
        moe = getattr(module, "moe", None)
        if moe is not None:
            stacks = sum(_bytes(getattr(module, name)) for name in ("w13", "w2"))
            total -= stacks - stacks * moe.top_k // moe.num_experts
    return total


def _bytes(weight) -> int:
    """A parameter's bytes, or a quantized weight's (its blocks, scales and zero points)."""
    tensors = [weight] if isinstance(weight, torch.Tensor) else list(weight.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
