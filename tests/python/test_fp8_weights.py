"""FP8 weights (the "fp8" format: E4M3 with float32 scales per row and group of inputs): the
quantizer against its formula, ``linear`` bit for bit against the dense kernel on the dequantized
weights on every ISA, and FP8 checkpoints (per-tensor, per-channel and block-wise scales, as vLLM
reads them) loading into it and generating what their dequantized weights give in transformers."""

import json
import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo import _C, LLM, SamplingParams
from octavo.layers.linear import QuantizedWeight, fp8_gemm, fp8_gemm_takes
from octavo.layers.quantize import quantize_fp8
from test_elementwise_ops import DTYPE_IDS, DTYPES
from test_linear import assert_close, reference

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(13)


def test_fp8_quantizer_and_dequantize(isa):
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 40)[:, None]
    w[5] = 0
    qw = quantize_fp8(w)
    q, s = qw.qweight, qw.scales
    assert q.dtype == FP8 and qw.group_size == 96 and s.shape == (40, 1)
    assert q.float().abs().amax(dim=1)[torch.arange(40) != 5].eq(448).all()
    assert torch.equal(q.view(torch.uint8), (w / s).to(FP8).view(torch.uint8))
    assert torch.equal(qw.dequantize(), q.float() * s)
    # E4M3 keeps 3 mantissa bits: within half a step (2^-4 of the value), or 2^-10 scales below 2^-6.
    assert ((qw.dequantize() - w).abs() <= torch.maximum(w.abs() / 16, s / 1024) * (1 + 1e-6)).all()


def block_weight(n: int, k: int, group: int) -> QuantizedWeight:
    """Every E4M3 code but NaN, with a scale per row and group of `group` inputs."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1
    scales = torch.rand(n, k // group) / 100 + 1e-3
    return QuantizedWeight(codes.view(FP8), "fp8", k, scales=scales, group_size=group)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (2, 33, 128), (3, 64, 576), (5, 9, 1536), (17, 66, 576), (64, 40, 256)])
@pytest.mark.parametrize("grouped", [False, True], ids=["per-row", "groups-of-64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_equals_the_dense_kernel_on_dequantized_weights(isa, dtype, grouped, m, n, k, bias):
    qw = block_weight(n, k, 64) if grouped else quantize_fp8(torch.randn(n, k))
    w = qw.dequantize()
    assert torch.equal(w, qw.qweight.float() * qw.scales.repeat_interleave(qw.group_size, 1))
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _C.ops.linear(out, x, qw.qweight, b, **qw.kernel_args())
    if dtype == torch.float32:
        dense = torch.empty_like(out)
        _C.ops.linear(dense, x, w, b)
        assert torch.equal(out, dense)
    assert_close(out, reference(x, w, b), dtype)


def w8a8_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """fp8_gemm's product in float64: each row of x rounded to E4M3 at scale max |x| / 448, times
    the dequantized weight."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=torch.finfo(torch.float32).tiny)
    rounded = (x.float() / scale).clamp(-448, 448).to(FP8).double() * scale.double()
    return rounded @ qw.dequantize().double().T


def assert_rows_close(got: torch.Tensor, expected: torch.Tensor):
    """Each bfloat16 row within one rounding of its own largest value (rows differ in scale by
    orders of magnitude), or of bfloat16's subnormal step (2^-133) where that is larger; a row of
    zeros exactly zeros."""
    size = expected.abs().amax(dim=1, keepdim=True)
    assert ((got.double() - expected).abs() <= torch.clamp(size * 2.0 ** -7, min=2.0 ** -133)).all()


@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (5, 48, 256), (33, 32, 576)])
def test_fp8_gemm_rounds_each_row_to_e4m3_then_multiplies(m, n, k):
    """W8A8 (layers.linear.fp8_gemm, for bfloat16 activations on FP8 tensor cores) against its
    formula, with a bias; and within E4M3's rounding of the weight-only product."""
    qw = quantize_fp8(torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None])
    x = (torch.randn(m, k) * torch.logspace(-3, 2, m)[:, None]).bfloat16()
    got = fp8_gemm(x, qw, None)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_rows_close(got, w8a8_reference(x, qw))
    weight_only = x.double() @ qw.dequantize().double().T
    assert ((got.double() - weight_only).abs() <= weight_only.abs().amax(dim=1, keepdim=True) / 8).all()
    bias = torch.randn(n).bfloat16()
    assert torch.equal(fp8_gemm(x, qw, bias), got + bias)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1e-40, -9e-41, 1e-38, 3.0e38, -3.3e38, 1.0, -448.0, 65504.0]) |
                st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=32, max_size=32))
def test_fp8_gemm_takes_rows_at_bfloat16s_limits(values):
    """A row of zeros, subnormals or values near bfloat16's largest gives its product at its own
    scale: the scale is a float32 normal, and no quotient passes 448 (small weights keep the
    products inside bfloat16's range)."""
    qw = quantize_fp8(torch.randn(16, 32) * 1e-3)
    x = torch.tensor([values, [0.0] * 32, [1.0] * 32]).bfloat16()
    got = fp8_gemm(x, qw, None)
    assert torch.isfinite(got).all()
    assert_rows_close(got, w8a8_reference(x, qw))
    assert torch.equal(got[1], torch.zeros(16, dtype=torch.bfloat16))


def test_fp8_gemm_takes_bfloat16_rows_and_per_row_scales_only():
    x = torch.randn(4, 256).bfloat16()
    per_row = quantize_fp8(torch.randn(32, 256))
    assert fp8_gemm_takes(x, per_row)
    assert not fp8_gemm_takes(x.half(), per_row) and not fp8_gemm_takes(x.float(), per_row)
    assert not fp8_gemm_takes(x, block_weight(32, 256, 128))  # block-wise scales
    assert not fp8_gemm_takes(x, quantize_fp8(torch.randn(24, 256)))  # N not in 16s
    from octavo.layers.quantize import quantize_int8
    assert not fp8_gemm_takes(x, quantize_int8(torch.randn(32, 256)))


def test_the_layer_keeps_fp8_weight_only_off_cuda(monkeypatch):
    """CUDA_FP8_GEMM_FROM_ROWS routes CUDA products only: a CPU product of any size stays the
    weight-only kernel's (the dense kernel on the dequantized weights, bit for bit)."""
    from octavo.layers import linear as layer

    monkeypatch.setattr(layer, "CUDA_FP8_GEMM_FROM_ROWS", 1)
    qw = quantize_fp8(torch.randn(32, 256))
    x = torch.randn(40, 256)
    dense = torch.empty(40, 32)
    _C.ops.linear(dense, x, qw.dequantize(), None)
    assert torch.equal(layer.linear(x, qw), dense)


def test_bad_fp8_arguments_are_named():
    qw = quantize_fp8(torch.randn(8, 128))
    out, x = torch.empty(2, 8), torch.randn(2, 128)
    with pytest.raises(ValueError, match="weight format fp8 needs scales"):
        _C.ops.linear(out, x, qw.qweight, None, weight_format="fp8", group_size=128)
    with pytest.raises(ValueError, match="must be float8_e4m3fn, got uint8"):
        _C.ops.linear(out, x, qw.qweight.view(torch.uint8), None, **qw.kernel_args())
    with pytest.raises(ValueError, match="group_size"):
        _C.ops.linear(out, x, qw.qweight, None, weight_format="fp8", scales=qw.scales, group_size=48)


# ---- FP8 checkpoints -------------------------------------------------------------------------

def fp8_checkpoint(src, dst, scheme: str, method: str = "fp8"):
    """A copy of checkpoint ``src`` with its decoder projections in FP8, as vLLM's FP8 checkpoints
    hold them: "tensor" (one weight_scale each, and a static input_scale), "channel" (a scale per
    output row) or "block" (weight_scale_inv per block of 32 x 64, DeepSeek-V3's layout); with
    ``method`` "compressed-tensors", as llm-compressor's FP8 (tensor) and FP8_DYNAMIC (channel)
    schemes write them. Returns {projection name: the weight it stands for}."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    stands_for = {}
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        w, prefix = tensors[name].float(), name[: -len(".weight")]
        n, k = w.shape
        if scheme == "block":
            s = w.view(n // 32, 32, k // 64, 64).abs().amax(dim=(1, 3)) / 448
            full = s.repeat_interleave(32, 0).repeat_interleave(64, 1)
            tensors[f"{prefix}.weight_scale_inv"] = s
        else:
            s = w.abs().amax() / 448 if scheme == "tensor" else w.abs().amax(dim=1, keepdim=True) / 448
            full = s.expand(n, k)
            tensors[f"{prefix}.weight_scale"] = s
        if scheme == "tensor":
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.02)
        q = (w / full).clamp(-448, 448).to(FP8)
        tensors[name] = q
        stands_for[name] = q.float() * full
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if scheme == "tensor"
                                     else "dynamic", **({"weight_block_size": [32, 64]} if scheme == "block" else {})}
    if method == "compressed-tensors":
        static = scheme == "tensor"
        group = {"targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": scheme, "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                       "strategy": "tensor" if static else "token", "dynamic": not static}}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return stands_for


@pytest.mark.parametrize("method,scheme", [("fp8", "tensor"), ("fp8", "channel"), ("fp8", "block"),
                                           ("compressed-tensors", "tensor"), ("compressed-tensors", "channel")])
def test_an_fp8_checkpoint_runs_on_its_e4m3_weights(tiny_path, tmp_path, method, scheme):
    """Every projection stays E4M3 (fused QKV and gate_up of parts with their own scales), and
    generation gives the tokens and logprobs of transformers' model on the dequantized weights."""
    import transformers

    stands_for = fp8_checkpoint(tiny_path, tmp_path / "fp8", scheme, method)
    if method == "compressed-tensors":  # fp8 activations are not int8 ones: the checkpoint may run on a GPU
        from octavo.loader.compressed_tensors import quantizes_activations

        config = json.loads((tmp_path / "fp8" / "config.json").read_text())
        assert not quantizes_activations(config["quantization_config"])
    llm = LLM(model=str(tmp_path / "fp8"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    formats = llm.apply_model(lambda m: {name: (t.weight_format, t.group_size) for name, (t, _, _)
                                         in m.weight_targets().items() if isinstance(t, QuantizedWeight)})[0]
    assert set(formats) == set(stands_for)
    assert {f for f, _ in formats.values()} == {"fp8"}
    assert {g for _, g in formats.values()} == ({64} if scheme == "block" else {128, 256})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        for name, w in stands_for.items():
            ref.get_parameter(name).copy_(w)
    prompt = list(range(5, 17))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    tokens = prompt + list(out.token_ids)
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([tokens])).logits[0].double(), -1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert int(logp[len(prompt) - 1 + step].argmax()) == token
        assert math.isclose(entry[token].logprob, float(logp[len(prompt) - 1 + step, token]), abs_tol=1e-4)


def test_fp8_checkpoints_that_cannot_load_are_named(tiny_path, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_checkpoint(tiny_path, tmp_path / "fp8", "channel")
    with pytest.raises(ValueError, match="needs float weights, but .* is a fp8 checkpoint"):
        LLM(model=str(tmp_path / "fp8"), quantization="int8", kv_cache_memory_bytes=8 << 20)
    # A NaN code (the CPU kernel would read it as 480 times the scale).
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name].view(torch.uint8)[3, 7] = 0xFF
    save_file(tensors, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' holds NaN"):
        LLM(model=str(tmp_path / "fp8"), kv_cache_memory_bytes=8 << 20)
    config_path = tmp_path / "fp8" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format 'e5m2' are not supported"):
        LLM(model=str(tmp_path / "fp8"), kv_cache_memory_bytes=8 << 20)

