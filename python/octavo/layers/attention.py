"""Paged attention for one layer: write the step's K/V into the cache, then attend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _C


@dataclass
class AttentionMetadata:
    """One step's batch layout, straight from the scheduler's arrays (int32 tensors).

    slot_mapping [T]; query_start_loc [R + 1]; seq_lens [R]; block_tables [R, max_blocks];
    plan [R + 1]: ``plan_paged_attention``'s, made on the host once per step for the CUDA kernels
    (None: they lay the batch out themselves, per layer). num_decodes: how many of the first
    requests have one query token each (on CUDA a step with prompt chunks runs those in the
    decode kernels, which split long contexts over the GPU).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    plan: torch.Tensor | None = None
    num_decodes: int = 0
    # Hybrid models (kv_groups.py): each KV group's metadata, this one first; a layer reads its
    # group's slot mapping and block table.
    groups: list[AttentionMetadata] | None = None


class Attention(torch.nn.Module):
    """Causal attention over the paged KV cache of one layer.

    The cache tensors are ``[num_blocks, num_kv_heads, block_size, head_size]`` and are set by
    the runner (``kv_cache``) before the first forward.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, sliding_window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale, self.sliding_window = scale, sliding_window
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_group = 0  # the KV group whose block table this layer reads (set with kv_cache)
        # An fp8 cache's (k_scale, v_scale): it holds K / k_scale and V / v_scale. 1.0 unless the
        # checkpoint has the layer's (vLLM's default too); other caches ignore them.
        self.kv_scales = (1.0, 1.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H * D], k and v [T, Hkv * D] (row-strided views are fine) -> [T, H * D]."""
        tokens = q.shape[0]
        key_cache, value_cache = self.kv_cache
        if meta.groups is not None:
            meta = meta.groups[self.kv_group]
        k_scale, v_scale = self.kv_scales if key_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        _C.ops.reshape_and_cache(k.view(tokens, self.num_kv_heads, self.head_size),
                                 v.view(tokens, self.num_kv_heads, self.head_size),
                                 key_cache, value_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        out = torch.empty(tokens, self.num_heads, self.head_size, dtype=q.dtype, device=q.device)
        _C.ops.paged_attention(out, q.view(tokens, self.num_heads, self.head_size), key_cache, value_cache,
                               meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                               self.sliding_window, plan=meta.plan, num_decodes=meta.num_decodes,
                               k_scale=k_scale, v_scale=v_scale)
        return out.view(tokens, self.num_heads * self.head_size)
