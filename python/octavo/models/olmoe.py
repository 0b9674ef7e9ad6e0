"""OLMoE: Llama attention with one RMSNorm over all of q and one over all of k (and q, k, v
clamped to ``clip_qkv`` where configured), and a sparse MoE MLP in every layer."""

from __future__ import annotations

from ..layers.moe import FusedMoE, MoEConfig
from .llama import LlamaAttention, LlamaForCausalLM


class OlmoeForCausalLM(LlamaForCausalLM):
    qk_norm = "whole"

    def make_attention(self) -> LlamaAttention:
        clip = self.config.hf.get("clip_qkv") or 0.0
        return LlamaAttention(self.config, self.dtype, self.shard, self.qk_norm, clip_qkv=float(clip))

    def make_mlp(self, layer: int) -> FusedMoE:
        return FusedMoE(self.config.hidden_size, MoEConfig.of(self.config.hf, "intermediate_size"), self.dtype, self.shard)
