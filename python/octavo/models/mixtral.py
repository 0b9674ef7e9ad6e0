"""Mixtral: Llama attention (with Mistral's sliding window where configured) and a sparse MoE
MLP in every layer, its experts named w1 (gate), w3 (up) and w2 (down) under
``block_sparse_moe``; the chosen experts' weights are always renormalized."""

from __future__ import annotations

import dataclasses

from ..layers.moe import FusedMoE, MoEConfig
from .llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_prefix = "block_sparse_moe."

    def make_mlp(self, layer: int) -> FusedMoE:
        moe = MoEConfig.of(self.config.hf, "intermediate_size", expert_names=("w1", "w3", "w2"))
        return FusedMoE(self.config.hidden_size, dataclasses.replace(moe, renormalize=True), self.dtype, self.shard)
