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


def assert_greedy_is(reference, outputs: list[list[int]], prompts=PROMPTS, tol: float = 1e-3) -> None:
    """Each prompt's greedy tokens equal the reference model's, but for a near-tie: where they
    part, the two tokens' log-probabilities under the reference are within ``tol`` (random tiny
    weights make exact ties, broken by the last bit of a sum whose order differs by kernel)."""
    for prompt, got in zip(prompts, outputs):
        expected = greedy(reference, prompt, len(got))
        step = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if step is None:
            continue
        with torch.no_grad():
            logprobs = reference(torch.tensor([prompt + expected[:step]])).logits[0, -1].float().log_softmax(-1)
        gap = float(logprobs[expected[step]] - logprobs[got[step]])
        assert gap < tol, f"token {step}: {got[step]}, the reference's greedy {expected[step]} ({gap:.4f} apart)"


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
    assert_greedy_is(reference, octavo_greedy(tmp_path))


def test_a_window_changes_the_tokens(tmp_path):
    """The window is applied: without it (every layer full) the long prompts' tokens differ."""
    tiny_gemma(tmp_path / "sliding", sliding_window=8)
    tiny_gemma(tmp_path / "full", sliding_window=8, layer_types=[FULL] * 6)
    sliding, full = octavo_greedy(tmp_path / "sliding"), octavo_greedy(tmp_path / "full")
    assert sliding[1] != full[1] and sliding[3] != full[3]


def test_hybrid_kv_groups_in_the_engine(tmp_path):
    """The engine runs Gemma 3 with a KV group per layer kind: its sliding layers hold only their
    window's blocks, a prompt that shares a long prefix hits the cache in every group, and the
    tokens stay transformers'."""
    reference = tiny_gemma(tmp_path, sliding_window=20)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=16 << 20,
              max_num_batched_tokens=64)
    engine = llm.llm_engine
    assert engine.info.kv_group_windows == [0, 20, 20, 20, 20, 20]  # 5 sliding layers + 1 full: groups of 1
    rng = np.random.default_rng(4)
    first = [int(t) for t in rng.integers(0, 300, 300)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("first", first, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.scheduler.block_pool.num_used_blocks)
    # Group 0: up to 20 blocks of 16 (305 tokens' KV); a sliding group: its window and a step's 64
    # tokens at most, against the 20 blocks each of full attention.
    assert 19 + 5 <= peak <= 20 + 5 * (-(-(20 - 1 + 64) // 16) + 1) < 6 * 20
    hits = engine.scheduler.prefix_cache_stats["hits"]
    second = first[:280] + [3, 4, 5]
    out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert engine.scheduler.prefix_cache_stats["hits"] - hits == 272  # 17 whole blocks in every group
    assert_greedy_is(reference, [list(out.outputs[0].token_ids)], [second])
    assert engine.scheduler.block_pool.num_used_blocks == 0


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
    assert_greedy_is(reference, octavo_greedy(gemma_gguf / "model.gguf"))
