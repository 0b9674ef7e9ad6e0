"""GGUF files of llama.cpp's quantization mixes: tiny Llamas whose tensors are each in their own type,
as llama.cpp's Q4_K_M mix lays them out (Q4_K attn_q / attn_k / ffn_gate / ffn_up, Q6_K attn_v,
ffn_down and the LM head, Q5_K elsewhere) and a mix of the other kept types (Q3_K, Q5_0, Q5_1,
IQ4_NL, Q8_0). Every tensor stays in its file's blocks, a fused projection whose parts differ keeps
one run of blocks per type (``MixedWeight``), and the greedy tokens are transformers' on the same
file (which dequantizes it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.layers.linear import MixedWeight, QuantizedWeight, linear  # noqa: E402
from octavo.loader import load_model  # noqa: E402
from octavo.loader.gguf_file import _unpermute_rows  # noqa: E402
from test_gguf_architectures import finish, gguf_name, gguf_writer, greedy  # noqa: E402
from test_linear_gguf import BLOCK_BYTES, HALVES, block_weights, set_halves  # noqa: E402
from test_models import tiny_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType
SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=False)  # whole super-blocks


def q4_k_m(layer: int, kind: str) -> Q:
    """llama.cpp's Q4_K_M choice, simplified: more bits where errors cost most."""
    if kind in ("attn_v", "ffn_down", "output"):
        return Q.Q6_K if layer % 2 == 0 or kind == "output" else Q.Q5_K
    return Q.Q5_K if kind == "attn_output" else Q.Q4_K


def others(layer: int, kind: str) -> Q:
    return {"attn_q": Q.Q5_0, "attn_k": Q.Q5_1, "attn_v": Q.IQ4_NL, "attn_output": Q.Q3_K, "ffn_gate": Q.Q8_0,
            "ffn_up": Q.Q5_0 if layer == 0 else Q.Q3_K, "ffn_down": Q.Q5_1, "output": Q.IQ4_NL}[kind]


MIXES = {"q4_k_m": q4_k_m, "others": others}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / block weights * block bytes] random blocks whose weights are about 0.02 in size."""
    fmt = qtype.name.lower()
    count = rows * cols // block_weights(fmt)
    blocks = rng.integers(0, 256, (count, BLOCK_BYTES[fmt]), dtype=np.uint8)
    # Quants reach 8 (Q8_0: 127); the K-quants multiply d by 6-bit (Q6_K: int8) scales too.
    size = {"q8_0": 127.0, "q6_k": 32.0 * 127, "q3_k": 4.0 * 32}.get(fmt, 16.0 * (32 if "_k" in fmt else 1))
    set_halves(blocks, fmt, rng.uniform(0.5, 1.0, (count, len(HALVES[fmt]))) * 0.03 / size)
    return blocks.reshape(rows, -1)


def write_mix(model, mix, path) -> None:
    """``model``'s config, norms and embedding (float32) with random blocks of the mix's type for
    every other matrix, as a llama GGUF file."""
    writer, rng = gguf_writer(model.config, "llama", path), np.random.default_rng(3)
    for name, tensor in model.state_dict().items():
        target = gguf_name(name)
        if tensor.dim() != 2 or target == "token_embd.weight":
            writer.add_tensor(target, tensor.float().numpy())
            continue
        layer = int(target.split(".")[1]) if target.startswith("blk.") else 0
        qtype = mix(layer, target.split(".")[-2])
        writer.add_tensor(target, random_blocks(qtype, *tensor.shape, rng), raw_dtype=qtype)
    finish(writer)


@pytest.fixture(scope="module", params=list(MIXES))
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_mix(tiny_checkpoint("llama", path / "hf", **SIZES), MIXES[request.param], path / "model.gguf")
    return request.param, path


def file_tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_every_tensor_keeps_its_own_blocks(written):
    """Each projection decodes to gguf's dequantized values of its own tensors, in its own type;
    q / k / v and gate / up fuse into one weight per run of one type."""
    mix, path = written
    model, tensors = load_model(path / "model.gguf"), file_tensors(path / "model.gguf")
    for i, layer in enumerate(model.layers):
        for weight, parts in ((layer.self_attn.qkv_weight, ("attn_q", "attn_k", "attn_v")),
                              (layer.mlp.gate_up_weight, ("ffn_gate", "ffn_up")),
                              (layer.mlp.down_weight, ("ffn_down",))):
            files = [tensors[f"blk.{i}.{p}.weight"] for p in parts]
            types = [t.tensor_type.name.lower() for t in files]
            runs = [types[0]] + [b for a, b in zip(types, types[1:]) if a != b]
            assert weight.weight_format == "+".join(runs) and isinstance(weight, MixedWeight) == (len(runs) > 1)
            expected = [gguf.quants.dequantize(t.data, t.tensor_type) for t in files]
            if parts[0] == "attn_q":  # llama.cpp interleaves Llama's q / k rows; the loader undoes it
                c = model.config
                expected[:2] = [_unpermute_rows(e, h) for e, h in zip(expected, (c.num_attention_heads,
                                                                                 c.num_key_value_heads))]
            assert torch.equal(weight.dequantize(), torch.from_numpy(np.concatenate(expected)))
    lm_head = tensors["output.weight"]
    assert torch.equal(model.lm_head.dequantize(),
                       torch.from_numpy(gguf.quants.dequantize(lm_head.data, lm_head.tensor_type)))


def test_a_mixed_weight_multiplies_each_run_in_its_format(written):
    """linear on a MixedWeight: each run's columns are its own product, bit for bit, with a bias."""
    _, path = written
    weight = load_model(path / "model.gguf").layers[0].self_attn.qkv_weight
    x, bias = torch.randn(3, 256), torch.randn(weight.shape[0])
    out, first = linear(x, weight, bias), 0
    parts = weight.parts if isinstance(weight, MixedWeight) else [weight]
    for part in parts:
        rows = part.shape[0]
        assert isinstance(part, QuantizedWeight)
        assert torch.equal(out[:, first:first + rows], linear(x, part, bias[first:first + rows]))
        first += rows
    assert first == out.shape[1] == weight.shape[0]
    assert torch.equal(weight.dequantize_rows(100, 300, torch.float32), weight.dequantize()[100:300])


def test_greedy_tokens_are_transformers(written):
    _, path = written
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, gguf_file="model.gguf", dtype=torch.float32)
    llm = LLM(str(path / "model.gguf"), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    prompts = [[5, 9, 13, 200], list(range(30, 70)), [7] * 9]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [greedy(reference, p, 12) for p in prompts]
