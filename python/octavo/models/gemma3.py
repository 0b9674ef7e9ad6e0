"""Gemma 3 (text): Gemma3ForCausalLM, computed as transformers' Gemma3TextModel computes it.

Beside Llama's structure:
- four norms a layer: the attention's and the MLP's outputs are normed before they join the
  residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the MLP's
  input by ``pre_feedforward_layernorm``;
- every norm scales by (1 + weight), 1 + weight taken in float32 at every call, as transformers
  does (the kernels' ``weight_offset``);
- RMSNorm over each head of q and k, and attention scaled by query_pre_attn_scalar ** -0.5;
- the embedding scaled by sqrt(hidden_size) rounded to the model's dtype;
- a GELU (tanh approximation) gated MLP;
- two kinds of layers (``layer_types``): sliding-window attention over the last
  ``sliding_window`` positions, with RoPE base ``rope_local_base_freq`` (10000), and full
  attention with the global base and its scaling;
- final logits soft-capped (tanh) where ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import rope_cos_sin_cache
from .llama import LlamaAttention, LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(hf: dict) -> list[str]:
    """Each layer's kind: the config's ``layer_types``, else every ``sliding_window_pattern``-th
    (default 6th) layer full attention, as transformers derives them for older configs."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(hf["num_hidden_layers"])]


def layer_rope(hf: dict, layer_type: str) -> dict:
    """A config whose RoPE parameters are those of ``layer_type``'s layers: transformers 5 keeps a
    dict per layer type in ``rope_parameters``; older configs give the global base as rope_theta
    (its scaling as rope_scaling) and the local one as rope_local_base_freq."""
    per_type = hf.get("rope_parameters") or {}
    if layer_type in per_type:
        rope = dict(per_type[layer_type])
    elif layer_type == SLIDING:
        rope = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq") or 10000.0}
    else:
        rope = {"rope_type": "default", **(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta") or 1e6}
    return {**hf, "rope_parameters": rope, "rope_scaling": None}


class Gemma3DecoderLayer(torch.nn.Module):
    """Norms before and after the attention and the MLP; the residual stream adds the normed outputs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, self_attn: LlamaAttention, mlp: torch.nn.Module,
                 sliding: bool):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype)
        self.sliding = sliding

    def forward(self, x, residual, positions, rope, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rope, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard=None, stage=None):
        hf = config.hf
        if hf.get("attn_logit_softcapping"):
            raise ValueError("Gemma attention logit soft-capping (attn_logit_softcapping) is not supported")
        self.kinds = layer_types(hf)
        super().__init__(config, dtype, shard, stage)
        for module in self.modules():  # the layers', q / k's and the final norm: all Gemma's (1 + w)
            if isinstance(module, RMSNorm):
                module.weight_offset = True
        with torch.device("cpu"):  # built in float64 on the CPU, as the global table
            local = rope_cos_sin_cache(self.rope_config(SLIDING))
        self.register_buffer("local_cos_sin_cache", local.to(self.cos_sin_cache.device), persistent=False)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale.to(self.cos_sin_cache.device), persistent=False)
        self.final_logit_softcapping = float(hf.get("final_logit_softcapping") or 0.0)

    def rope_config(self, layer_type: str | None = None) -> dict:
        return layer_rope(self.config.hf, layer_type or FULL)

    def make_layer(self, layer: int) -> Gemma3DecoderLayer:
        c, sliding = self.config, self.kinds[layer] == SLIDING
        scale = float(c.hf.get("query_pre_attn_scalar") or c.head_dim) ** -0.5
        attn = LlamaAttention(c, self.dtype, self.shard, self.qk_norm, scale=scale,
                              sliding_window=c.sliding_window if sliding else 0)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.dtype, self.shard,
                       activation=c.hf.get("hidden_activation") or "gelu_pytorch_tanh")
        return Gemma3DecoderLayer(c, self.dtype, attn, mlp, sliding)

    def rope_of(self, layer: Gemma3DecoderLayer) -> tuple[torch.Tensor, bool]:
        return (self.local_cos_sin_cache if layer.sliding else self.cos_sin_cache), self.rope_is_neox

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, logits_indices, out)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def weight_targets(self) -> dict:
        targets = super().weight_targets()
        for i, layer in enumerate(self.layers, self.first_layer):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                norm = getattr(layer, name).weight
                targets[f"model.layers.{i}.{name}.weight"] = (norm, 0, norm.shape[0])
        return targets
