"""EAGLE draft heads for Llama-family targets (speculative decoding's "eagle" and "eagle3").

A head is one decoder layer (or a few) that reads the target's hidden states besides tokens:
at position i it takes the embedding of token i + 1 and the target's hidden state at i, and its
output predicts token i + 2. Its next pass takes its own output in the target's place.

- EAGLE (method "eagle"): fc maps [embedding, target's final hidden state] to the layer's input;
  the first layer has no input norm; the output goes to the target's own LM head, unnormed.
- EAGLE-3 ("eagle3"): fc maps the residual streams entering three of the target's layers to one
  hidden state; the first layer's QKV reads [input_layernorm(embedding), hidden_norm(hidden)],
  twice the hidden width; a final norm and the head's own LM head over a draft vocabulary
  follow, whose token j is the target's j + d2t[j].

Checkpoints are EAGLE's (config.json + safetensors or pytorch_model.bin): ``fc``, ``layers.N.*``
(EAGLE-3: ``midlayer.*``), and for EAGLE-3 ``norm``, ``lm_head``, ``d2t``. A head without
``embed_tokens`` uses the target's embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..config import ModelConfig
from ..distributed.shards import TPShard
from ..layers.linear import embedding, linear, param
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import rope_cos_sin_cache, rope_is_neox
from .llama import LlamaAttention, LlamaDecoderLayer

def aux_hidden_layers(head: ModelConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head reads: its config's
    ``eagle_aux_hidden_state_layer_ids`` (also under ``eagle_config``), else vLLM's default
    (2, L // 2, L - 3) for a target of L layers."""
    hf = head.hf
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_target_layers
                            for i in ids):
        raise ValueError(f"an EAGLE-3 head reads the inputs of 3 of the target's {num_target_layers} layers, got "
                         f"{list(ids)} (set eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return ids


class EagleHead(torch.nn.Module):
    """forward(input_ids [T], positions [T], hidden [T, H], meta) -> (normed [T, H], hidden for
    the next pass [T, H]); ``greedy(normed, rows)`` -> the target-vocabulary argmax of those rows.
    ``combine(target_hidden)``: the target's hidden states (EAGLE: final; EAGLE-3: its aux streams,
    concatenated) as the first pass's ``hidden``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, target, eagle3: bool):
        super().__init__()
        self.config, self.dtype, self.eagle3 = config, dtype, eagle3
        self.shard = TPShard.of(config)  # whole, on the driver
        h = config.hidden_size
        if h != target.config.hidden_size and not eagle3:
            raise ValueError(f"an EAGLE head's hidden size ({h}) must be the target's ({target.config.hidden_size})")
        self.embed_tokens = target.embed_tokens  # shared, unless its checkpoint has one (load_weights)
        target_h = config.hf.get("target_hidden_size") or target.config.hidden_size
        self.fc_weight = param(h, (3 * target_h) if eagle3 else 2 * h, dtype=dtype)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, dtype, LlamaAttention(config, dtype, self.shard,
                                                            input_size=2 * h if eagle3 and i == 0 else None),
                              GatedMLP(h, config.intermediate_size, dtype, self.shard))
            for i in range(config.num_hidden_layers))
        if eagle3:
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps, dtype)
            self.norm = RMSNorm(h, config.rms_norm_eps, dtype)
            self.draft_vocab_size = config.hf.get("draft_vocab_size") or config.vocab_size
            self.lm_head = param(self.draft_vocab_size, h, dtype=dtype)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
            self.norm_before_residual = bool(config.hf.get("norm_before_residual", False))
        else:
            self.lm_head = target.lm_head  # shared
        with torch.device("cpu"):
            table = rope_cos_sin_cache(config.hf)
        self.register_buffer("cos_sin_cache", table.to(target.embed_tokens.device), persistent=False)
        self.rope_is_neox = rope_is_neox(config.hf)

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return linear(target_hidden, self.fc_weight) if self.eagle3 else target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta):
        embeds = embedding(input_ids, self.embed_tokens, self.dtype)
        first, rope = self.layers[0], (self.cos_sin_cache, self.rope_is_neox)
        if self.eagle3:
            normed = self.hidden_norm(hidden)
            residual = normed.clone() if self.norm_before_residual else hidden
            x = torch.cat([first.input_layernorm(embeds), normed], dim=-1)
        else:  # the first layer has no input norm
            x = linear(torch.cat([embeds, hidden], dim=-1), self.fc_weight)
            residual = x
        x = first.self_attn(x, positions, rope, meta)
        x, residual = first.post_attention_layernorm(x, residual)
        x = first.mlp(x)
        for layer in self.layers[1:]:
            x, residual = layer(x, residual, positions, rope, meta)
        if self.eagle3:
            return self.norm(x, residual)
        out = x + residual
        return out, out

    def greedy(self, normed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        best = linear(normed[rows], self.lm_head).argmax(dim=-1)
        return best + self.d2t[best] if self.eagle3 else best

    # ---- weights ------------------------------------------------------------------------------

    def weight_targets(self) -> dict:
        h = self.config.hidden_size
        targets = {"fc.weight": (self.fc_weight, 0, h)}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            targets.update(layer.self_attn.weight_targets(f"{p}self_attn."))
            targets.update(layer.mlp.weight_targets(f"{p}mlp."))
            if i or self.eagle3:
                targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm.weight, 0, h)
            targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, h)
        if self.eagle3:
            targets["layers.0.hidden_norm.weight"] = (self.hidden_norm.weight, 0, h)
            targets["norm.weight"] = (self.norm.weight, 0, h)
            targets["lm_head.weight"] = (self.lm_head, 0, self.draft_vocab_size)
            targets["d2t"] = (self.d2t, 0, self.draft_vocab_size)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """EAGLE's tensor names, with or without a ``model.`` prefix; EAGLE-3's ``midlayer.`` is
        layer 0. Unknown, mis-shaped or missing tensors raise ValueError."""
        targets, seen = self.weight_targets(), set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d" or (name == "layers.0.input_layernorm.weight" and not self.eagle3):
                continue  # the reverse map; EAGLE's first layer has no input norm
            if name == "embed_tokens.weight":
                self._own_embedding(tensor)
                continue
            if name not in targets:
                raise ValueError(f"EAGLE head tensor {name!r} is not used by method "
                                 f"{'eagle3' if self.eagle3 else 'eagle'}")
            target, start, rows = targets[name]
            dest = target.data[start:start + rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"EAGLE head tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dest.shape)} from its config.json and the target")
            dest.copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(f"the EAGLE head's checkpoint lacks {', '.join(missing[:5])}")

    def _own_embedding(self, tensor: torch.Tensor) -> None:
        expected = tuple(self.embed_tokens.shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"EAGLE head tensor 'embed_tokens.weight' has shape {tuple(tensor.shape)}, expected "
                             f"{expected} (the target's embedding)")
        self.embed_tokens = torch.nn.Parameter(tensor.to(self.dtype).clone(), requires_grad=False)


def head_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """An EAGLE checkpoint's tensors: safetensors, else EAGLE's own pytorch_model.bin."""
    from ..loader.safetensors_files import iter_safetensors

    path = Path(path)
    if any(path.glob("*.safetensors")):
        yield from iter_safetensors(path)
        return
    bin_file = path / "pytorch_model.bin"
    if not bin_file.is_file():
        raise FileNotFoundError(f"no EAGLE head weights in {path} (*.safetensors or pytorch_model.bin)")
    yield from torch.load(bin_file, map_location="cpu", weights_only=True).items()


def load_eagle_head(path: str | Path, method: str, target) -> EagleHead:
    """The head in ``path`` for ``target`` (a loaded LlamaForCausalLM on one rank), in the
    target's dtype and on its device. An EAGLE-3 head makes the target keep its aux streams."""
    if target.shard.world > 1:
        raise ValueError("EAGLE heads are not supported with tensor parallelism yet (they share the target's "
                         "embedding and LM head, which tensor parallelism cuts)")
    config = ModelConfig.from_pretrained(path)
    if config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the EAGLE head's vocabulary ({config.vocab_size} tokens) is not the target's "
                         f"({target.config.vocab_size})")
    with torch.device(target.embed_tokens.device):
        head = EagleHead(config, target.dtype, target, method == "eagle3")
    head.load_weights(head_tensors(path))
    if method == "eagle3":
        target.aux_hidden_layers = aux_hidden_layers(config, target.config.num_hidden_layers)
    return head.eval()
