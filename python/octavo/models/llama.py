"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) on Octavo's kernels, and
the base of the mixture-of-experts models (models/mixtral.py, qwen_moe.py, olmoe.py).

Dense projections go through ``layers.linear`` (Octavo's kernel or torch) with fused weights
(one QKV and one gate_up matrix); norms, RoPE, attention over the paged cache and the activation
go through ``octavo._C.ops``. The dense variants differ only in flags read from the config: q/k/v
biases (Qwen2), per-head q/k RMSNorm (Qwen3) and a sliding window (Mistral). A decoder layer is
built from parts (its attention and its MLP), so an MoE model is a subclass that picks its MLP.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .. import _C
from ..config import ModelConfig
from ..distributed.parallel_state import all_reduce, gather_vocab
from ..distributed.shards import PPStage, TPShard, split
from ..layers.attention import Attention, AttentionMetadata
from ..layers.linear import QuantizedWeight, embedding, linear, param
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import rope_cos_sin_cache, rope_is_neox


class LlamaAttention(torch.nn.Module):
    """Column-parallel QKV (this rank's heads), row-parallel output projection.

    ``qk_norm``: None, "head" (Qwen3: an RMSNorm over each head of q and k) or "whole" (OLMoE:
    one RMSNorm over all of q and one over all of k, so every rank would need every head).
    ``clip_qkv`` > 0 clamps q, k and v to [-clip_qkv, clip_qkv] after the norms (OLMoE).
    ``input_size``: the width QKV reads, when not the hidden size (an EAGLE-3 head's first layer).
    ``scale`` (default head_dim ** -0.5) and ``sliding_window`` (default the config's): where a
    model sets them per layer (Gemma 3)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TPShard, qk_norm: str | None = None,
                 clip_qkv: float = 0.0, input_size: int | None = None, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        heads, kv_heads, d = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size, self.kv_size, self.head_dim = heads * d, kv_heads * d, d
        self.qk_norm, self.clip_qkv, self.shard = qk_norm, clip_qkv, shard
        if qk_norm == "whole" and shard.world > 1:
            raise ValueError(f"{config.architecture} normalizes q and k over all heads at once; "
                             f"tensor parallel is not supported for it")
        self.qkv_weight = param(self.q_size + 2 * self.kv_size, input_size or config.hidden_size, dtype=dtype)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size, dtype=dtype) if config.attention_bias else None
        self.o_weight = param(config.hidden_size, self.q_size, dtype=dtype)
        norm_sizes = {None: None, "head": (d, d), "whole": (self.q_size, self.kv_size)}[qk_norm]
        self.q_norm = RMSNorm(norm_sizes[0], config.rms_norm_eps, dtype) if norm_sizes else None
        self.k_norm = RMSNorm(norm_sizes[1], config.rms_norm_eps, dtype) if norm_sizes else None
        window = config.sliding_window if sliding_window is None else sliding_window
        self.attn = Attention(heads, kv_heads, d, d**-0.5 if scale is None else scale, window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, bool],
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "head":  # Qwen3: RMSNorm over each head before RoPE, read in place in qkv
            q = self.q_norm(q.view(len(q), -1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.view(len(k), -1, self.head_dim)).view(k.shape)
        elif self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        cos_sin_cache, is_neox = rope
        _C.ops.rotary_embedding(positions, q, k, self.head_dim, cos_sin_cache, is_neox)
        return all_reduce(linear(self.attn(q, k, v, meta), self.o_weight))

    def weight_targets(self, prefix: str) -> dict:
        q, kv = self.q_size, self.kv_size
        targets = {}
        for name, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            targets[f"{prefix}{name}.weight"] = (self.qkv_weight, start, rows)
            if self.qkv_bias is not None:
                targets[f"{prefix}{name}.bias"] = (self.qkv_bias, start, rows)
        targets[f"{prefix}o_proj.weight"] = (self.o_weight, 0, self.o_weight.shape[0])
        if self.q_norm is not None:
            targets[f"{prefix}q_norm.weight"] = (self.q_norm.weight, 0, self.q_norm.weight.shape[0])
            targets[f"{prefix}k_norm.weight"] = (self.k_norm.weight, 0, self.k_norm.weight.shape[0])
        return targets

    def shard_slices(self, prefix: str, config: ModelConfig) -> dict:
        s, d = self.shard, self.head_dim
        q, kv = (s.q_heads[0] * d, s.q_heads[1] * d), (s.kv_heads[0] * d, s.kv_heads[1] * d)
        heads, kv_heads = config.num_attention_heads * d, config.num_key_value_heads * d
        slices = {}
        for kind in ("weight", "bias"):
            slices[f"{prefix}q_proj.{kind}"] = (0, *q, heads)
            slices[f"{prefix}k_proj.{kind}"] = (0, *kv, kv_heads)
            slices[f"{prefix}v_proj.{kind}"] = (0, *kv, kv_heads)
        slices[f"{prefix}o_proj.weight"] = (1, *q, heads)
        return slices


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm attention and MLP with residuals; the MLP is a part (dense or mixture of experts)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, self_attn: LlamaAttention, mlp: torch.nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, x, residual, positions, rope, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# A layer's fp8 KV cache scales in checkpoints (the names vLLM reads: llm-compressor's k_scale /
# v_scale, older files' projection output scales, one kv_scale for both) -> which of (k, v) it sets.
KV_SCALE_NAMES = {"self_attn.k_scale": (0,), "self_attn.v_scale": (1,), "self_attn.kv_scale": (0, 1),
                  "self_attn.k_proj.output_scale": (0,), "self_attn.v_proj.output_scale": (1,)}


class LlamaForCausalLM(torch.nn.Module):
    """forward(input_ids [T], positions [T], meta) -> hidden [T, hidden];
    compute_logits(hidden, logits_indices [R]) -> float32 [R, vocab].

    ``shard``: the part a tensor-parallel rank holds (distributed/shards.py; default: all of it).
    The embedding and the LM head hold the rank's vocabulary rows. ``stage``: the layers a
    pipeline stage holds; a stage before the last returns its activations for the next one
    (forward's ``intermediate``) instead of hidden states, and holds no LM head.

    A variant is a subclass that changes the parts: ``qk_norm`` (see LlamaAttention), the MLP a
    layer gets (``make_mlp``: dense here, a mixture of experts in the MoE models) and the prefix
    its checkpoint names the MLP's tensors under."""

    qk_norm: str | None = None
    mlp_prefix = "mlp."
    # Layers whose input the forward pass keeps in aux_hidden_states (an EAGLE-3 draft head's).
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TPShard | None = None,
                 stage: PPStage | None = None):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.shard = shard = shard or TPShard.of(config)
        self.stage = stage = stage or PPStage.of(config)
        # Every rank's vocabulary rows, in rank order: how the LM head's slices join.
        self.vocab_sizes = [end - begin for begin, end in (split(config.vocab_size, shard.world, r)
                                                           for r in range(shard.world))]
        # A stage without the embedding keeps an empty one: where the model lives, for its users.
        embeds = stage.is_first or (stage.is_last and config.tie_word_embeddings)
        self.embed_tokens = param(shard.vocab_size if embeds else 0, config.hidden_size, dtype=dtype)
        self.first_layer = stage.layers[0]
        self.layers = torch.nn.ModuleList(self.make_layer(i) for i in range(*stage.layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else param(
            shard.vocab_size if stage.is_last else 0, config.hidden_size, dtype=dtype)
        with torch.device("cpu"):  # the table is built in float64 on the CPU, wherever the model lives
            table = rope_cos_sin_cache(self.rope_config())
        self.register_buffer("cos_sin_cache", table.to(self.embed_tokens.device), persistent=False)
        self.rope_is_neox = rope_is_neox(config.hf)

    def rope_config(self, layer_type: str | None = None) -> dict:
        """The config the RoPE table of ``layer_type``'s layers is built from (one table here)."""
        return self.config.hf

    def make_layer(self, layer: int) -> torch.nn.Module:
        """Decoder layer ``layer`` (its index in the whole model)."""
        return LlamaDecoderLayer(self.config, self.dtype, self.make_attention(), self.make_mlp(layer))

    def make_attention(self) -> LlamaAttention:
        return LlamaAttention(self.config, self.dtype, self.shard, self.qk_norm)

    def make_mlp(self, layer: int) -> torch.nn.Module:
        """The MLP of decoder layer ``layer`` (its index in the whole model)."""
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size, self.dtype, self.shard)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """intermediate: the previous stage's activations (every stage but the first). Returns
        the final hidden states [T, hidden] (last stage) or this stage's activations
        [2, T, hidden] (the layers' output and the residual stream) for the next stage.
        inputs_embeds: the tokens' embeddings (``embed``'s) in place of input_ids; the layers
        overwrite them."""
        if intermediate is None:
            x, residual = self.embed(input_ids) if inputs_embeds is None else inputs_embeds, None
        else:
            x, residual = intermediate[0], intermediate[1]
        streams = {}
        for i, layer in enumerate(self.layers, self.first_layer):
            if i in self.aux_hidden_layers:  # the residual stream entering layer i (an EAGLE-3 head reads it)
                streams[i] = x.clone() if residual is None else x + residual  # the layers add in place
            x, residual = layer(x, residual, positions, self.rope_of(layer), meta)
        self.aux_hidden_states = [streams[i] for i in self.aux_hidden_layers]
        if not self.stage.is_last:
            return torch.stack([x, residual])
        x, _ = self.norm(x, residual)
        return x

    def rope_of(self, layer: torch.nn.Module) -> tuple[torch.Tensor, bool]:
        """The RoPE table and pair layout ``layer`` rotates with (one for all layers here)."""
        return self.cos_sin_cache, self.rope_is_neox

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for input_ids [T]: [T, hidden]."""
        if self.shard.world == 1:
            return embedding(input_ids, self.embed_tokens, self.dtype)
        first, end = self.shard.vocab  # rows of other ranks' tokens are zeros here, their rank's there
        local = input_ids.long() - first
        outside = (local < 0) | (local >= end - first)
        x = embedding(local.masked_fill(outside, 0), self.embed_tokens, self.dtype)
        return all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where a quantized LM head may write this rank's logits (ModelRunner.logits_out)."""
        return gather_vocab(linear(hidden[logits_indices], self.lm_head, out=out).float(), self.vocab_sizes)

    # ---- weights ------------------------------------------------------------------------------

    def weight_targets(self) -> dict[str, tuple[torch.Tensor | QuantizedWeight, int, int]]:
        """HF tensor name -> (destination parameter, first row, rows) for every expected tensor;
        a quantized loader may have put a ``QuantizedWeight`` in a parameter's place."""
        c, vocab = self.config, self.shard.vocab_size
        targets = {}
        if self.embed_tokens.shape[0]:
            targets["model.embed_tokens.weight"] = (self.embed_tokens, 0, vocab)
        if self.stage.is_last:
            targets["model.norm.weight"] = (self.norm.weight, 0, c.hidden_size)
            if not c.tie_word_embeddings:
                targets["lm_head.weight"] = (self.lm_head, 0, vocab)
        for i, layer in enumerate(self.layers, self.first_layer):
            p = f"model.layers.{i}."
            targets.update(layer.self_attn.weight_targets(f"{p}self_attn."))
            targets.update(layer.mlp.weight_targets(p + self.mlp_prefix))
            targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm.weight, 0, c.hidden_size)
            targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, c.hidden_size)
        return targets

    def shard_slices(self) -> dict[str, tuple[int, int, int, int]]:
        """HF tensor name -> (dim, begin, end, full size of dim) of the part of it this rank
        holds, for the tensors tensor parallelism cuts (none on one rank)."""
        c, s = self.config, self.shard
        if s.world == 1:
            return {}
        slices = {"model.embed_tokens.weight": (0, *s.vocab, c.vocab_size)}
        if not c.tie_word_embeddings:
            slices["lm_head.weight"] = (0, *s.vocab, c.vocab_size)
        for i, layer in enumerate(self.layers, self.first_layer):
            p = f"model.layers.{i}."
            slices.update(layer.self_attn.shard_slices(f"{p}self_attn.", c))
            slices.update(layer.mlp.shard_slices(p + self.mlp_prefix))
        return slices

    def matmul_weights(self) -> list[tuple[torch.nn.Module, str, list[str]]]:
        """Every weight ``linear`` reads, as (owner module, attribute, the checkpoint tensors
        stacked in it, in row order): the fused projections and the LM head, whose part is the
        embedding's tensor when the two are tied. Quantized loaders replace these attributes;
        the embedding itself stays a float table for lookups, and a part's ``float_weights``
        (an MoE router) stay floats too."""
        parts: dict[int, list[tuple[int, str]]] = {}
        for name, (target, start, _) in self.weight_targets().items():
            parts.setdefault(id(target), []).append((start, name))
        return [(module, attr, [name for _, name in sorted(parts[id(p)])])
                for module in self.modules() for attr, p in module._parameters.items()
                if p is not None and p.dim() == 2 and attr != "embed_tokens" and id(p) in parts
                and attr not in getattr(module, "float_weights", ())]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the fused parameters, casting to the model
        dtype. Unknown, mis-shaped or missing tensors raise ValueError naming them. Weights a
        quantized loader has placed already (``place_quantized``) are neither filled nor missing."""
        targets, slices, seen = self.weight_targets(), self.shard_slices(), set()
        for name, tensor in weights:
            if self.load_kv_scale(name, tensor):
                continue
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue  # derived from the config / the same tensor as the embedding
            if name not in targets and self.held_by_another_rank(name):
                continue
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} is not used by {self.config.architecture}")
            target, start, rows = targets[name]
            if isinstance(target, QuantizedWeight):
                raise ValueError(f"checkpoint tensor {name!r} is part of a quantized weight placed already")
            dest = target.data[start:start + rows]
            expected, cut = list(dest.shape), slices.get(name)
            if cut is not None:  # tensor parallel: this rank's part of the tensor
                expected[cut[0]] = cut[3]
            if list(tensor.shape) != expected:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(expected)} from config.json")
            dest.copy_(tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1]))
            seen.add(name)
        placed = {name for name, (target, _, _) in self.weight_targets().items() if isinstance(target, QuantizedWeight)}
        missing = sorted(set(targets) - placed - seen)  # `weights` may place quantized weights as it goes
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint lacks tensors {', '.join(missing[:5])}{more}")

    def load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Takes checkpoint tensor ``name`` if it is a layer's fp8 KV cache scale (a scalar, into
        its Attention's ``kv_scales``); returns whether it was one."""
        parts = name.split(".", 3)
        which = KV_SCALE_NAMES.get(parts[3]) if len(parts) == 4 and parts[:2] == ["model", "layers"] else None
        if which is None:
            return False
        if self.held_by_another_rank(name):
            return True
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
        if value is None or not (math.isfinite(value) and value > 0):
            shown = tuple(tensor.shape) if value is None else value
            raise ValueError(f"checkpoint tensor {name!r} must be one positive, finite KV cache scale, got {shown}")
        attn = self.layers[int(parts[2]) - self.first_layer].self_attn.attn
        attn.kv_scales = tuple(value if i in which else old for i, old in enumerate(attn.kv_scales))
        return True

    def held_by_another_rank(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (any HF name: weight, bias, a quantized weight's
        parts) belongs to a pipeline stage other than this one, or to another rank's experts
        (expert parallel)."""
        if name.startswith("model.layers."):
            begin, end = self.stage.layers
            if not begin <= int(name.split(".")[2]) < end:
                return True
            return ".experts." in name and name in self._other_ranks_experts()
        if self.stage.world == 1:
            return False
        if name == "model.embed_tokens.weight":
            return not self.embed_tokens.shape[0]
        return name in ("model.norm.weight", "lm_head.weight") and not self.stage.is_last

    def _other_ranks_experts(self) -> set[str]:
        if not hasattr(self, "_elsewhere"):
            self._elsewhere = {name for i, layer in enumerate(self.layers, self.first_layer)
                               if hasattr(layer.mlp, "held_elsewhere")
                               for name in layer.mlp.held_elsewhere(f"model.layers.{i}.{self.mlp_prefix}")}
        return self._elsewhere


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"
