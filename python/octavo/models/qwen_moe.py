"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 attention with a sparse MoE MLP in the layers
``decoder_sparse_step`` and ``mlp_only_layers`` choose (the others keep a dense MLP of
``intermediate_size``). Qwen2-MoE adds a shared expert behind a sigmoid gate; the experts are
``moe_intermediate_size`` wide and renormalized where ``norm_topk_prob`` says so."""

from __future__ import annotations

import torch

from ..layers.moe import FusedMoE, MoEConfig
from .llama import LlamaForCausalLM


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> torch.nn.Module:
        hf = self.config.hf
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        sparse = (experts > 0 and layer not in (hf.get("mlp_only_layers") or [])
                  and (layer + 1) % (hf.get("decoder_sparse_step") or 1) == 0)
        if not sparse:
            return super().make_mlp(layer)
        return FusedMoE(self.config.hidden_size, MoEConfig.of(hf), self.dtype, self.shard)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = "head"

