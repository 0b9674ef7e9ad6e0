"""Llama, Qwen2, Qwen3 and Gemma 3 GGUF files run as they are: the model's projections keep the
file's blocks (``QuantizedWeight``; KEPT_FORMATS: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and the
K-quants Q3_K to Q6_K), and so does the token embedding, whose lookups decode only the rows they
read; everything else is read as floats. Each tensor keeps its own format: a fused projection whose parts differ (a
Q4_K_M file's attn_v in Q6_K beside attn_q / attn_k in Q4_K) keeps a run of blocks per format
(``MixedWeight``). A llama file with experts (``llama.expert_count``: Mixtral) runs as
MixtralForCausalLM and a ``qwen3moe`` file as Qwen3MoeForCausalLM, each 3-D expert tensor
(``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``) read as its experts' matrices, whose
blocks are stacked into the MoE layer's expert stacks as they are.

The config is read from the file's metadata (as transformers' GGUF loader names it), the tokenizer
through transformers' GGUF support. The header and tensors are read by ``gguf_reader.py`` (the
``gguf`` package gives the tensor types' names and dequantizes types Octavo does not keep):
llama.cpp's names are mapped to Hugging Face's, and in Llama files the rows of attn_q / attn_k are
put back in Hugging Face's order (llama.cpp's converter interleaves the two rotary halves of every
head of Llama's, not of Qwen's; this is the inverse, as transformers applies it).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

from .. import _C
from ..config import ModelConfig
from ..distributed.shards import PPStage, TPShard
from ..layers.linear import MixedWeight, QuantizedWeight
from ..layers.quantize import place_quantized, replace_weight
from ..models import model_class
from .gguf_reader import GgufReader

# GGUF type name -> the weight format that keeps its blocks
KEPT_FORMATS = {name: name.lower() for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q3_K", "Q4_K",
                                                "Q5_K", "Q6_K")}
FLOAT_TYPES = {"F32", "F16", "BF16"}
# llama.cpp's architecture name -> Hugging Face's (Mistral's files are "llama" ones).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM"}

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "ffn_gate_inp": "block_sparse_moe.gate", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm"}
# Where an architecture names a layer's tensors otherwise: Gemma 3's ffn_norm is the MLP's input
# norm, and its attention and MLP outputs have norms of their own.
_LAYER_BY_ARCH = {"gemma3": {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                             "post_attention_norm": "post_attention_layernorm",
                             "post_ffw_norm": "post_feedforward_layernorm"},
                  "qwen3moe": {**_LAYER, "ffn_gate_inp": "mlp.gate"}}
# A layer's 3-D expert tensor -> the module of its experts and the name of each one's matrix in it:
# Mixtral's (a llama file with experts), else Qwen-MoE's.
_EXPERTS = {"llama": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
            "qwen3moe": ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"})}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def hf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> Hugging Face's ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    parts, layer = name.split("."), _LAYER_BY_ARCH.get(arch, _LAYER)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {name!r} has no place in the model")


def expert_names(name: str, count: int, arch: str = "llama") -> list[str] | None:
    """The Hugging Face names of the experts stacked in a 3-D expert tensor ("blk.3.ffn_up_exps.weight"
    -> "model.layers.3.block_sparse_moe.experts.{j}.w3.weight" for j < count in a llama file,
    "model.layers.3.mlp.experts.{j}.up_proj.weight" in a qwen3moe one); None for any other tensor."""
    module, names = _EXPERTS.get(arch, _EXPERTS["llama"])
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in names:
        return None
    return [f"model.layers.{parts[1]}.{module}.experts.{j}.{names[parts[2]]}.{parts[3]}" for j in range(count)]


def open_reader(path: Path) -> GgufReader:
    try:
        return GgufReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read the GGUF metadata of {path}: {e}") from e


# Hugging Face config name -> the GGUF metadata key after the architecture's name and a dot;
# head_dim is attention.key_length where the file has it (Qwen3 writes it).
_CONFIG_KEYS = {"max_position_embeddings": "context_length", "hidden_size": "embedding_length",
                "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
                "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
                "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
                "head_dim": "rope.dimension_count", "vocab_size": "vocab_size"}
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}


def gguf_config(path: Path, reader=None) -> ModelConfig:
    """The model config in the file's metadata (the names transformers' GGUF loader gives them).
    ``reader``: the file's GgufReader, when one is open already."""
    reader = reader or open_reader(path)
    fields = reader.fields
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path} is a {arch!r} GGUF; Octavo runs GGUF files of the architectures "
                         f"{', '.join(ARCHITECTURES)}")
    if any(name.startswith(f"{arch}.rope.scaling") for name in fields):
        raise ValueError(f"{path} uses RoPE scaling, which Octavo does not read from GGUF metadata yet")
    hf = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu", "torch_dtype": "float32",
          "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    if fields.get(f"{arch}.expert_count") and arch == "llama":  # llama.cpp writes Mixtral as llama with experts
        hf.update(architectures=["MixtralForCausalLM"], num_local_experts=fields[f"{arch}.expert_count"],
                  num_experts_per_tok=fields[f"{arch}.expert_used_count"])
    if arch == "qwen3moe":  # every layer sparse, top-k weights renormalized (llama.cpp's qwen3moe)
        hf.update(num_experts=fields[f"{arch}.expert_count"], num_experts_per_tok=fields[f"{arch}.expert_used_count"],
                  moe_intermediate_size=fields[f"{arch}.expert_feed_forward_length"], norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[])
    hf.update((name, fields[f"{arch}.{key}"]) for name, key in _CONFIG_KEYS.items() if f"{arch}.{key}" in fields)
    if f"{arch}.attention.key_length" in fields:
        hf["head_dim"] = fields[f"{arch}.attention.key_length"]
    hf.update((name, fields[f"tokenizer.ggml.{key}"]) for name, key in _TOKEN_IDS.items()
              if f"tokenizer.ggml.{key}" in fields)
    if arch == "gemma3":
        hf.update(_gemma3_config(hf, fields))
    if "vocab_size" not in hf:
        hf["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    return ModelConfig.from_dict(hf)


def _gemma3_config(hf: dict, fields) -> dict:
    """What a Gemma 3 file leaves to the architecture, as llama.cpp and transformers fill it in: every
    6th layer full attention, the others sliding over ``attention.sliding_window`` positions with
    RoPE base 10000 (rope.freq_base is the full layers'), GELU (tanh), and attention scaled by
    head_dim ** -0.5, except Gemma 3 27B's by (hidden / heads) ** -0.5 (llama.cpp's rule)."""
    layers, theta = hf["num_hidden_layers"], hf.pop("rope_theta", 1e6)
    scalar = hf["hidden_size"] // hf["num_attention_heads"] if layers == 62 else hf["head_dim"]
    return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": fields.get("gemma3.attention.sliding_window"), "query_pre_attn_scalar": scalar,
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order: within each head, rows (2i, 2i+1) go back to (i, i + d/2)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _read_tensors(reader, config: ModelConfig) -> dict[str, tuple[str | None, np.ndarray]]:
    """HF name -> (weight format or None for floats, array in HF row order)."""
    import gguf

    arch = config.hf["model_type"]
    permuted = arch == "llama"  # llama.cpp's converter permutes only Llama's q / k
    tensors = {}
    for t in reader.tensors:
        experts = expert_names(t.name, t.data.shape[0], arch) if t.data.ndim == 3 else None
        name, kind = experts[0] if experts else hf_name(t.name, arch), t.tensor_type.name
        data = t.data
        if kind == "BF16":  # its bytes: the upper halves of float32s
            data, kind = (data.view("<u2").astype(np.uint32) << 16).view(np.float32), "F32"
        if kind not in KEPT_FORMATS and kind not in FLOAT_TYPES:
            try:
                data = gguf.quants.dequantize(data, t.tensor_type)
            except NotImplementedError:
                raise ValueError(f"GGUF tensor {t.name!r} is of type {kind}, which Octavo cannot read "
                                 f"(supported: {', '.join(sorted(KEPT_FORMATS) + sorted(FLOAT_TYPES))})") from None
            kind = "F32"
        if arch == "gemma3" and name.endswith("norm.weight") and kind not in KEPT_FORMATS:
            data = data - np.float32(1)  # stored as 1 + w by llama.cpp; w, as transformers reads it
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = _unpermute_rows(data, heads)
        for j, expert in enumerate(experts or [name]):
            tensors[expert] = (KEPT_FORMATS.get(kind), data[j] if experts else data)
    return tensors


def _in_features(weight_format: str, data: np.ndarray) -> int:
    return data.shape[1] // _C.ops.weight_block_bytes(weight_format) * _C.ops.weight_block_weights(weight_format)


def _as_float(weight_format: str | None, data: np.ndarray) -> torch.Tensor:
    if weight_format is None:
        return torch.from_numpy(np.array(data)).float()
    weight = QuantizedWeight(torch.from_numpy(np.array(data)), weight_format, _in_features(weight_format, data))
    return weight.dequantize()


def _cut_blocks(weight_format: str, data: np.ndarray, cut: tuple[int, int, int, int] | None) -> np.ndarray | None:
    """A tensor-parallel rank's part of a block-quantized tensor: rows (outputs) as they are,
    inputs in whole blocks; None where an input cut falls inside a block."""
    if cut is None:
        return data
    dim, begin, end, _ = cut
    if dim == 0:
        return data[begin:end]
    weights, block = _C.ops.weight_block_weights(weight_format), _C.ops.weight_block_bytes(weight_format)
    if begin % weights or end % weights:
        return None
    return data[:, begin // weights * block:end // weights * block]


def _place_blocks(model, tensors: dict[str, tuple[str | None, np.ndarray]]) -> set[str]:
    """Each matmul weight whose parts share one kept format becomes their blocks, stacked (a tied
    LM head takes the embedding's); see place_quantized. Returns the tensors so placed. Tensor
    parallel: each part is this rank's (``model.shard_slices``); a part whose cut falls inside a
    block is not placed, and loads as floats that ``load_weights`` cuts."""
    slices = model.shard_slices()
    kept = {}
    for name, (fmt, data) in tensors.items():
        part = None if fmt is None else _cut_blocks(fmt, data, slices.get(name))
        if part is not None:
            kept[name] = (fmt, part)

    def stacked(names: list[str]) -> QuantizedWeight:
        fmt, data = kept[names[0]][0], np.concatenate([kept[name][1] for name in names])
        return QuantizedWeight(torch.from_numpy(data), fmt, _in_features(fmt, data))

    def blocks(names: list[str]) -> QuantizedWeight | None:
        # Runs of parts in one format share blocks; a fused weight of several runs keeps each in
        # its own format (MixedWeight), except experts, whose stacks fused_moe reads in one.
        runs = [list(run) for _, run in itertools.groupby(names, key=lambda name: kept[name][0])]
        if len(runs) == 1:
            return stacked(names)
        if any(".experts." in name for name in names):
            return None
        return MixedWeight([stacked(run) for run in runs])

    shapes = {name: (data.shape[0], _in_features(fmt, data)) for name, (fmt, data) in kept.items()}
    placed = place_quantized(model, shapes, blocks)
    return placed | _place_embedding(model, kept, stacked)


def _place_embedding(model, kept: dict, stacked) -> set[str]:
    """The token embedding in its blocks too (lookups decode the rows they read): the LM head's
    own blocks where the two are tied, else the embedding tensor's."""
    name, table = "model.embed_tokens.weight", getattr(model, "embed_tokens", None)
    if name not in kept or table is None or not table.shape[0]:
        return set()
    head = getattr(model, "lm_head", None)
    tied = model.config.tie_word_embeddings and isinstance(head, QuantizedWeight)
    replace_weight(model, "embed_tokens", head if tied else stacked([name]))
    return {name}


def load_gguf_model(path: str | Path, dtype: torch.dtype | str = "auto", tp_rank: int = 0, tp_size: int = 1,
                    pp_rank: int = 0, pp_size: int = 1, expert_parallel: bool = False):
    """The model of a GGUF file (ARCHITECTURES), with its quantized projections kept quantized. Float
    parts (norms, the embedding table for lookups) are in ``dtype`` ("auto": float32).
    ``tp_rank`` of ``tp_size``: that tensor-parallel rank's part of every tensor (quantized ones
    cut in their blocks); ``pp_rank`` of ``pp_size``: that pipeline stage's layers only."""
    path = Path(path)
    reader = open_reader(path)
    config = gguf_config(path, reader)
    if dtype in ("auto", "float32"):
        dtype = torch.float32
    elif isinstance(dtype, str):
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = model_class(config.architecture)(config, dtype, TPShard.of(config, tp_rank, tp_size, expert_parallel),
                                             PPStage.of(config, pp_rank, pp_size))
    tensors = {name: t for name, t in _read_tensors(reader, config).items() if not model.held_by_another_rank(name)}
    quantized = _place_blocks(model, tensors)
    model.load_weights((name, _as_float(fmt, data)) for name, (fmt, data) in tensors.items() if name not in quantized)
    return model.eval()
