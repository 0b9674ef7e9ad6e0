"""Gemma 3 (text): tiny random checkpoints made with transformers (windows smaller than a KV block
and larger, soft-capped logits, a query_pre_attn_scalar apart from head_dim), a tiny Gemma 3 GGUF
written as llama.cpp lays one out (norms stored as 1 + w, K-quant blocks), and the greedy tokens
of each equal to transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from octavo import LLM, SamplingParams
from octavo.layers.linear import MixedWeight, QuantizedWeight
from octavo.loader import load_model
from octavo.loader.gguf_file import gguf_config
from octavo.models.gemma3 import FULL, SLIDING, layer_rope, layer_types
from test_gguf_architectures import finish, gguf_writer, greedy

TINY = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6)
PROMPTS = [[5, 9, 13, 200], list(range(30, 70)), [7] * 9,
           [int(t) for t in np.random.default_rng(2).integers(0, 300, 90)]]


def tiny_gemma(path, **overrides) -> torch.nn.Module:
    """A random Gemma3ForCausalLM saved at ``path``, its norm weights random too (they are zeros,
    a scale of 1, at initialization: a test of 1 + w needs them apart from 0)."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**TINY, **overrides})).float().eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def octavo_greedy(path, n: int = 12) -> list[list[int]]:
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_layer_kinds_and_rope_bases_from_new_and_old_configs():
    new = {"num_hidden_layers": 7, "layer_types": [SLIDING] * 6 + [FULL],
           "rope_parameters": {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               SLIDING: {"rope_type": "default", "rope_theta": 1e4}}}
    assert layer_types(new) == [SLIDING] * 6 + [FULL]
    assert layer_rope(new, FULL)["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    old = {"num_hidden_layers": 7, "sliding_window_pattern": 3, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert layer_types(old) == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    assert layer_rope(old, SLIDING)["rope_parameters"] == {"rope_type": "default", "rope_theta": 2e4}
    assert layer_rope(old, FULL)["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}


# A window below one KV block (16), one across blocks, and one past every prompt; soft-capping and
# a query_pre_attn_scalar that is not head_dim on the first.
CASES = {"window-8-softcap": dict(sliding_window=8, final_logit_softcapping=30.0, query_pre_attn_scalar=24),
         "window-20": dict(sliding_window=20), "window-512": dict(sliding_window=512)}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_are_transformers(case, tmp_path):
    reference = tiny_gemma(tmp_path, **CASES[case])
    assert octavo_greedy(tmp_path) == [greedy(reference, p, 12) for p in PROMPTS]


def test_a_window_changes_the_tokens(tmp_path):
    """The window is applied: without it (every layer full) the long prompts' tokens differ."""
    tiny_gemma(tmp_path / "sliding", sliding_window=8)
    tiny_gemma(tmp_path / "full", sliding_window=8, layer_types=[FULL] * 6)
    sliding, full = octavo_greedy(tmp_path / "sliding"), octavo_greedy(tmp_path / "full")
    assert sliding[1] != full[1] and sliding[3] != full[3]


# ---- a Gemma 3 GGUF --------------------------------------------------------------------------

# head_dim 256: a file does not say query_pre_attn_scalar; llama.cpp takes head_dim (hidden / heads
# for the 27B), transformers its default 256: the two agree here, as on every Gemma 3 but the 27B.
GGUF_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=256, num_key_value_heads=1, sliding_window=8)
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gemma3_gguf(model, path) -> None:
    """``model``'s config and norms (stored 1 + w, as llama.cpp's converter writes Gemma's), random
    K-quant blocks for its projections (Q4_K, with v and down in Q6_K as in a Q4_K_M file) and its
    embedding in Q8_0 blocks of its own weights."""
    import gguf
    from test_gguf_kquants import random_blocks

    c, rng = model.config, np.random.default_rng(5)
    writer = gguf_writer(c, "gemma3", path)
    writer.add_sliding_window(c.sliding_window)
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", data + 1)
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            target = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
            if data.ndim == 1:
                writer.add_tensor(target, data + 1)
                continue
            qtype = gguf.GGMLQuantizationType.Q6_K if module in ("self_attn.v_proj", "mlp.down_proj") \
                else gguf.GGMLQuantizationType.Q4_K
            writer.add_tensor(target, random_blocks(qtype, *data.shape, rng), raw_dtype=qtype)
    finish(writer)


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    write_gemma3_gguf(tiny_gemma(path / "hf", **GGUF_SIZES), path / "model.gguf")
    return path


def test_a_gemma3_gguf_keeps_its_blocks_and_reads_its_config(gemma_gguf):
    config = gguf_config(gemma_gguf / "model.gguf")
    assert config.architecture == "Gemma3ForCausalLM" and config.sliding_window == 8
    assert layer_types(config.hf) == [SLIDING] * 5 + [FULL]
    model = load_model(gemma_gguf / "model.gguf")
    qkv = model.layers[0].self_attn.qkv_weight
    assert isinstance(qkv, MixedWeight) and qkv.weight_format == "q4_k+q6_k"
    assert model.embed_tokens is model.lm_head and isinstance(model.lm_head, QuantizedWeight)
    reference = transformers.AutoModelForCausalLM.from_pretrained(gemma_gguf, gguf_file="model.gguf",
                                                                  dtype=torch.float32)
    theirs = reference.model.layers[2].pre_feedforward_layernorm.weight
    assert torch.equal(model.layers[2].pre_feedforward_layernorm.weight, theirs)  # the file's 1 + w, less 1


def test_a_gemma3_ggufs_greedy_tokens_are_transformers(gemma_gguf):
    reference = transformers.AutoModelForCausalLM.from_pretrained(gemma_gguf, gguf_file="model.gguf",
                                                                  dtype=torch.float32)
    assert octavo_greedy(gemma_gguf / "model.gguf") == [greedy(reference, p, 12) for p in PROMPTS]
