"""Octavo's load-time formats: int8 per output row and int4 per group with zero points. The
quantizers against their formulas, ``dequantize`` against a float reference built from the
quantized integers, and ``linear`` bit-exact against the dense kernel on the dequantized weights
and close to float64, on every compiled ISA."""

import pytest
import torch
import torch.nn.functional as F

from octavo import _C
from octavo.layers.linear import CPU_BF16_GEMM_FROM_ROWS, QuantizedWeight, _on_amx_tiles, linear
from octavo.layers.quantize import (int4_group_size, pack_nibbles, quantize_int4, quantize_int8, quantize_model,
                                    quantize_q4_1)
from test_elementwise_ops import DTYPE_IDS, DTYPES
from test_linear import assert_close, reference


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(11)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    chunks = packed.view(n, half // 16, 16)
    return torch.stack([chunks & 15, chunks >> 4], dim=2).reshape(n, half * 2)


def test_int8_quantizer_and_dequantize(isa):
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 40)[:, None]
    w[5] = 0
    qw = quantize_int8(w)
    q, s = qw.qweight, qw.scales
    assert q.dtype == torch.int8 and q.abs().max() == 127 and s.shape == (40,)
    assert torch.equal(q, torch.round(w / s[:, None]).to(torch.int8))
    assert torch.equal(qw.dequantize(), q.float() * s[:, None])
    assert ((qw.dequantize() - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("k,wanted,group", [(576, 128, 96), (1536, 128, 128), (96, 128, 96), (64, 32, 32), (160, 128, 32)])
def test_int4_quantizer_and_dequantize(isa, k, wanted, group):
    assert int4_group_size(k, wanted) == group
    w = torch.randn(24, k)
    qw = quantize_int4(w, wanted)
    q, s, z = unpack_nibbles(qw.qweight), qw.scales, qw.zeros
    assert qw.group_size == group and s.shape == z.shape == (24, k // group) and int(q.max()) <= 15
    assert torch.equal(pack_nibbles(q), qw.qweight)
    expected = ((q.view(24, k // group, group).float() - z[..., None].float()) * s[..., None]).reshape(24, k)
    assert torch.equal(qw.dequantize(), expected)
    assert ((qw.dequantize() - w).abs() <= s.repeat_interleave(group, 1) * (0.5 + 1e-4)).all()


def test_q4_1_quantizer_writes_llama_cpps_blocks():
    """Byte for byte what gguf's reference quantizer writes, flat and zero blocks included, and
    a model whose weights are Q4_1 values gets them back exactly."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    w = torch.randn(6, 160)
    w[1, :32], w[2, 32:64] = 0.25, 0.0
    ours = quantize_q4_1(w)
    theirs = quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert ours.weight_format == "q4_1" and torch.equal(ours.qweight, torch.from_numpy(theirs))
    on_grid = ours.dequantize()
    assert torch.equal(quantize_q4_1(on_grid).dequantize(), on_grid)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (2, 33, 128), (3, 64, 576), (5, 9, 1536), (17, 66, 576), (64, 40, 256)])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_equals_the_dense_kernel_on_dequantized_weights(isa, dtype, method, m, n, k, bias):
    qw = quantize_int8(torch.randn(n, k)) if method == "int8" else quantize_int4(torch.randn(n, k))
    w = qw.dequantize()
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _C.ops.linear(out, x, qw.qweight, b, **qw.kernel_args())
    # torch's GEMM on bfloat16 weights, but for int8 on AMX tiles (INT8_BF16_TILES_FROM_ROWS)
    if dtype == torch.bfloat16 and m >= CPU_BF16_GEMM_FROM_ROWS and not _on_amx_tiles(method, m):
        torch.testing.assert_close(linear(x, qw, b), F.linear(x, qw.dequantize(torch.bfloat16), b))
    else:
        assert torch.equal(out, linear(x, qw, b))
    if dtype == torch.float32:
        dense = torch.empty_like(out)
        _C.ops.linear(dense, x, w, b)
        assert torch.equal(out, dense)
    assert_close(out, reference(x, w, b), dtype)


@pytest.mark.parametrize("n,k", [(40, 64), (50, 2048), (7, 96)])
def test_int8_bfloat16_rows_on_amx_tiles_do_not_depend_on_the_batch(isa, n, k):
    """int8 weights with bfloat16 inputs: from 4 rows the AMX level multiplies on bf16 tiles, 64
    rows per pass (linear_int8_bf16_tiles.h). Any batch of at least 4 rows gives a row the same
    bits (partial tiles of weight rows and of input rows, passes of 1-4 input tiles, several
    passes); a non-finite input row stays in its row; every level is close to float64."""
    qw = quantize_int8(torch.randn(n, k))
    x = torch.randn(150, k).bfloat16()
    x[37, 5] = float("nan")
    b = torch.randn(n).bfloat16()

    def run(rows):
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        _C.ops.linear(out, rows, qw.qweight, b, **qw.kernel_args())
        return out

    full = run(x)
    assert full[37].isnan().all() and full[[36, 38]].isfinite().all()
    finite = torch.ones(150, dtype=torch.bool)
    finite[37] = False
    assert_close(full[finite], reference(x[finite], qw.dequantize(), b), torch.bfloat16)
    if _C.cpu_isa() == "amx":
        for begin, end in ((0, 4), (4, 20), (20, 53), (53, 101), (101, 150), (10, 150)):
            torch.testing.assert_close(run(x[begin:end]), full[begin:end], rtol=0, atol=0, equal_nan=True)


def test_bad_quantization_arguments_are_named():
    qw = quantize_int4(torch.randn(8, 128), 64)
    out, x = torch.empty(2, 8), torch.randn(2, 128)
    with pytest.raises(ValueError, match="needs scales and zeros"):
        _C.ops.linear(out, x, qw.qweight, None, weight_format="int4", group_size=64)
    with pytest.raises(ValueError, match="group_size"):
        _C.ops.linear(out, x, qw.qweight, None, weight_format="int4", scales=qw.scales, zeros=qw.zeros, group_size=48)
    with pytest.raises(ValueError, match="scales"):  # [8, 2] scales for group size 32 (needs [8, 4])
        _C.ops.linear(out, x, qw.qweight, None, weight_format="int4", scales=qw.scales, zeros=qw.zeros, group_size=32)
    with pytest.raises(ValueError, match="int8 needs scales"):
        _C.ops.linear(out, x, torch.zeros(8, 128, dtype=torch.int8), None, weight_format="int8")
    with pytest.raises(ValueError, match="must be int8"):
        _C.ops.linear(out, x, qw.qweight, None, weight_format="int8", scales=torch.ones(8))
    with pytest.raises(ValueError, match="unsupported quantization method 'fp6'"):
        quantize_model(torch.nn.Module(), "fp6")
    with pytest.raises(ValueError, match=r"tensor_cores \(linear on tensor cores\) is for CUDA only"):
        _C.ops.linear(out.bfloat16(), x.bfloat16(), qw.qweight, None, **qw.kernel_args(), tensor_cores=True)


def test_quantize_model_replaces_the_projections():
    from test_models import tiny_checkpoint
    from octavo.loader import load_model
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        tiny_checkpoint("llama", path, tie_word_embeddings=True)
        model = quantize_model(load_model(path, "float32"), "int4")
    layer = model.layers[0]
    for weight in (layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight,
                   layer.mlp.down_weight):
        assert isinstance(weight, QuantizedWeight) and weight.weight_format == "int4"
    assert isinstance(model.lm_head, QuantizedWeight) and model.lm_head.weight_format == "int8"
    assert isinstance(model.embed_tokens, torch.nn.Parameter)  # lookups stay float


@pytest.mark.parametrize("method", ["int8", "int4", "q4_1", "fp8"])
@pytest.mark.parametrize("dtype,tied", [("float32", True), ("bfloat16", False)])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(tmp_path, monkeypatch, method, dtype, tied):
    """load_model(quantization=) quantizes each projection as its parts arrive: the very weights
    quantize_model makes from the loaded model, while no projection's floats reach the model."""
    from octavo.loader import load_model
    from octavo.models.llama import LlamaForCausalLM
    from test_models import tiny_checkpoint

    tiny_checkpoint("llama", tmp_path, tie_word_embeddings=tied)
    whole = quantize_model(load_model(tmp_path, dtype), method)
    filled = []
    load_weights = LlamaForCausalLM.load_weights
    monkeypatch.setattr(LlamaForCausalLM, "load_weights",
                        lambda self, weights: load_weights(self, (filled.append(n) or (n, t) for n, t in weights)))
    streamed = load_model(tmp_path, dtype, quantization=method)
    assert not [n for n in filled if n.endswith("_proj.weight") or n == "lm_head.weight"]
    assert ("model.embed_tokens.weight" in filled) and torch.equal(streamed.embed_tokens, whole.embed_tokens)
    ours, theirs = dict(streamed.named_buffers()), dict(whole.named_buffers())
    assert ours.keys() == theirs.keys() and any(k.endswith("qweight") for k in ours)
    for name, buffer in theirs.items():
        assert torch.equal(ours[name], buffer), name
    assert streamed.lm_head.weight_format == "int8"


def test_quantizing_while_loading_refuses_what_it_cannot_do(tmp_path):
    from safetensors.torch import load_file, save_file

    from octavo.loader import load_model
    from test_models import tiny_checkpoint

    tiny_checkpoint("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint lacks tensors model\.layers\.1\.self_attn\.v_proj\.weight$"):
        load_model(tmp_path, quantization="int4")
    with pytest.raises(ValueError, match="unsupported quantization method 'int3'"):
        load_model(tmp_path, quantization="int3")
    with pytest.raises(ValueError, match="cannot be loaded on cuda: head size 32 has no CUDA attention kernel"):
        load_model(tmp_path, device="cuda", quantization="int4")  # refused by load_model itself


@pytest.mark.parametrize("method", ["int8", "int4", "q4_1", "fp8"])
def test_octavo_quantize_writes_a_checkpoint_that_loads_as_it_is(tmp_path, method):
    from octavo import LLM, SamplingParams
    from octavo.entrypoints.cli import main
    from test_detokenizer import _byte_level_bpe
    from test_models import tiny_checkpoint

    src = tmp_path / "float"
    tokenizer = _byte_level_bpe()
    tokenizer.save_pretrained(src)
    tiny_checkpoint("llama", src, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert main(["quantize", str(src), str(tmp_path / "q"), "--method", method]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    on_the_fly = LLM(model=str(src), quantization=method, kv_cache_memory_bytes=16 << 20)
    saved = LLM(model=str(tmp_path / "q"), kv_cache_memory_bytes=16 << 20)
    weight = saved.apply_model(lambda m: m.layers[1].mlp.gate_up_weight)[0]
    assert isinstance(weight, QuantizedWeight) and weight.weight_format == method
    assert torch.equal(weight.dequantize(), on_the_fly.apply_model(lambda m: m.layers[1].mlp.gate_up_weight.dequantize())[0])
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    assert [o.outputs[0].token_ids for o in saved.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in on_the_fly.generate(prompts, params, use_tqdm=False)]
    assert main(["quantize", str(src), str(tmp_path / "q"), "--method", method]) == 1  # dst is not empty


def test_an_octavo_checkpoint_missing_or_adding_tensors_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from octavo.entrypoints.cli import main
    from octavo.loader import load_model
    from test_models import tiny_checkpoint

    tiny_checkpoint("llama", tmp_path / "float")
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", "int4"]) == 0
    file = tmp_path / "q" / "model.safetensors"
    tensors = load_file(str(file))
    for change, message in ((lambda t: t.pop("layers.1.mlp.down_weight.scales"),
                             "lacks tensor 'layers.1.mlp.down_weight.scales'"),
                            (lambda t: t.pop("norm.weight"), "lacks tensor 'norm.weight'"),
                            (lambda t: t.update(extra=torch.zeros(2)), "not used by the model: extra")):
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(file))
        with pytest.raises(ValueError, match=message):
            load_model(tmp_path / "q")


def test_a_foreign_quantization_method_is_named(tmp_path):
    import json

    from octavo.loader import load_model
    from test_models import tiny_checkpoint

    tiny_checkpoint("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'bitsandbytes'"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_permuted_input_order_applies_once_at_every_row_count(dtype):
    """Act-order GPTQ weights read the activations' columns in their stored order: once, on each
    side of the row counts where 16-bit activations change path (float32 inputs, torch's GEMM)."""
    whole = quantize_int4(torch.randn(40, 128), 32)
    qw = QuantizedWeight(whole.qweight, "int4", 128, scales=whole.scales, zeros=whole.zeros, group_size=32,
                         input_order=torch.randperm(128))
    w = qw.dequantize()  # in the activations' order
    for m in (1, 5, 16, 64):
        x = torch.randn(m, 128).to(dtype)
        assert_close(linear(x, qw), reference(x, w, None), dtype)
