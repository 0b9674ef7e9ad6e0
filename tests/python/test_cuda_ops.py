"""The CUDA kernels against the CPU kernels on the same inputs (the CPU kernels are themselves
tested against float64 in test_elementwise_ops.py and test_attention.py). Runs only where a GPU
is present and this build carries CUDA kernels."""

import copy

import pytest
import torch
from octavo import _C

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _C.cuda_compiled(), reason="this build of Octavo has no CUDA kernels")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def assert_matches_cpu(gpu: torch.Tensor, cpu: torch.Tensor):
    """Equal up to one rounding of the dtype (the kernels sum in different orders); float32 gets
    a few more bits, since the CPU's vectorized exp / erf / tanh and CUDA's differ by ulps."""
    ulp = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[cpu.dtype]
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), rtol=ulp, atol=ulp * cpu.float().abs().max().item())


def on_gpu(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


# ----------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("weight_offset", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 17), (5, 4095), (64, 1024), (3, 576), (2, 8192)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(dtype, rows, hidden, weight_offset):
    x = (torch.randn(rows, hidden) * 2).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    out = torch.empty_like(x)
    _C.ops.rms_norm(out, x, w, 1e-6, weight_offset)
    gx, gw = on_gpu(x, w)
    gout = torch.empty_like(gx)
    _C.ops.rms_norm(gout, gx, gw, 1e-6, weight_offset)
    torch.cuda.synchronize()
    assert_matches_cpu(gout, out)


@pytest.mark.parametrize("hidden", [64, 4096, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm_and_strided_rows(dtype, hidden):
    # A row stride wider than the row (a view into a larger buffer), as for a fused QKV output.
    base = torch.randn(9, hidden + 8).to(dtype)
    x, residual = base[:, :hidden], torch.randn(9, hidden).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    gbase, gresidual, gw = on_gpu(base, residual, w)
    gx = gbase[:, :hidden]
    _C.ops.fused_add_rms_norm(x, residual, w, 1e-5)
    _C.ops.fused_add_rms_norm(gx, gresidual, gw, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(gresidual.cpu(), residual)  # one rounding of the same sum
    assert_matches_cpu(gx, x)
    assert torch.equal(gbase[:, hidden:].cpu(), base[:, hidden:])  # the gap between rows is untouched


# ----------------------------------------------------------------------------- activations

@pytest.mark.parametrize("op", ["silu", "gelu_none", "gelu_tanh"])
@pytest.mark.parametrize("rows,d", [(1, 64), (9, 1536), (4, 13), (300, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_activations(dtype, rows, d, op):
    x = (torch.randn(rows, 2 * d) * 3).to(dtype)
    outs = []
    for t in (x, x.cuda()):
        out = torch.empty(rows, d, dtype=dtype, device=t.device)
        if op == "silu":
            _C.ops.silu_and_mul(out, t)
        else:
            _C.ops.gelu_and_mul(out, t, op.split("_")[1])
        outs.append(out)
    torch.cuda.synchronize()
    assert_matches_cpu(outs[1], outs[0])


# ----------------------------------------------------------------------------- rotary_embedding

def cos_sin_cache(max_position: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 128), (128, 64), (256, 256)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_embedding(dtype, index_dtype, head_size, rot_dim, is_neox):
    tokens, heads, kv_heads = 7, 8, 2
    positions = torch.randint(0, 4096, (tokens,), dtype=index_dtype)
    q = torch.randn(tokens, heads * head_size).to(dtype)
    k = torch.randn(tokens, kv_heads, head_size).to(dtype)
    cache = cos_sin_cache(4096, rot_dim)
    gq, gk = on_gpu(q, k)
    _C.ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
    _C.ops.rotary_embedding(positions.cuda(), gq, gk, head_size, cache.cuda(), is_neox)
    torch.cuda.synchronize()
    assert_matches_cpu(gq, q)
    assert_matches_cpu(gk, k)


def test_rotary_embedding_skips_positions_outside_the_cache():
    q = torch.randn(3, 64, device="cuda")
    before = q.clone()
    positions = torch.tensor([5, 100, -1], device="cuda")
    _C.ops.rotary_embedding(positions, q, None, 64, cos_sin_cache(16, 64).cuda(), True)
    torch.cuda.synchronize()
    assert not torch.equal(q[0], before[0])
    assert torch.equal(q[1:], before[1:])


# ----------------------------------------------------------------------------- reshape_and_cache

@pytest.mark.parametrize("head_size", [64, 128, 256, 12])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reshape_and_cache_writes_the_same_slots(dtype, head_size):
    num_blocks, kv_heads, block_size, tokens = 6, 4, 16, 20
    key, value = torch.randn(tokens, kv_heads, head_size).to(dtype), torch.randn(tokens, kv_heads, head_size).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(torch.int64)
    slots[3] = -1  # skipped
    caches = [torch.zeros(num_blocks, kv_heads, block_size, head_size, dtype=dtype) for _ in range(2)]
    gcaches = on_gpu(*caches)
    _C.ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    _C.ops.reshape_and_cache(key.cuda(), value.cuda(), gcaches[0], gcaches[1], slots.cuda())
    torch.cuda.synchronize()
    assert torch.equal(gcaches[0].cpu(), caches[0]) and torch.equal(gcaches[1].cpu(), caches[1])
    assert caches[0].abs().sum() > 0


def test_reshape_and_cache_skips_slots_outside_the_cache():
    key = torch.randn(2, 1, 8, device="cuda")
    caches = [torch.zeros(1, 1, 4, 8, device="cuda") for _ in range(2)]
    _C.ops.reshape_and_cache(key, key, caches[0], caches[1], torch.tensor([1, 4], device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    assert torch.equal(caches[0][0, 0, 1], key[0, 0]) and caches[0].abs().sum() == key[0].abs().sum()


# ----------------------------------------------------------------------------- linear and dequantize

QUANTIZED = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q3_k", "q4_k", "q5_k", "q6_k", "int8", "int4", "fp8"]


def random_quantized(fmt: str, n: int, k: int):
    """A QuantizedWeight on the CPU: int8 / int4 / fp8 from Octavo's quantizer, GGUF blocks as
    test_linear_gguf makes them (k rounded up to whole blocks of the format)."""
    from octavo.layers.linear import QuantizedWeight
    from octavo.layers.quantize import quantize_fp8, quantize_int4, quantize_int8
    from test_linear_gguf import inputs, quantized

    if fmt in ("int8", "int4", "fp8"):
        w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]
        return {"int8": quantize_int8, "int4": lambda w: quantize_int4(w, 64), "fp8": quantize_fp8}[fmt](w)
    k = inputs(k, fmt)
    return QuantizedWeight(quantized(n, k, fmt), fmt, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantize_gives_the_cpu_floats_bit_for_bit(fmt, dtype):
    weight = random_quantized(fmt, 33, 1536)
    expected = weight.dequantize(dtype)
    assert torch.equal(weight.to("cuda").dequantize(dtype).cpu(), expected)  # .to moves the module itself


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 7, 64), (2, 33, 96), (3, 64, 576), (4, 9, 1536), (5, 130, 32),
                                   (16, 4096, 4096), (9, 17, 256)])
@pytest.mark.parametrize("fmt", QUANTIZED + ["dense"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_matches_the_cpu(dtype, fmt, m, n, k, bias):
    weight = torch.randn(n, k).to(dtype) if fmt == "dense" else random_quantized(fmt, n, k)
    k = weight.shape[1]  # whole blocks of the format
    x, b = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype) if bias else None

    def run(device: str) -> torch.Tensor:
        w = weight.to(device)  # a QuantizedWeight moves itself
        data, args = (w, {}) if fmt == "dense" else (w.qweight, w.kernel_args())
        out = torch.empty(m, n, dtype=dtype, device=device)
        _C.ops.linear(out, x.to(device), data, None if b is None else b.to(device), **args)
        return out.cpu()

    expected = run("cpu")
    assert_matches_cpu(run("cuda"), expected)


@pytest.mark.parametrize("fmt", ["q4_0", "int4", "int8", "fp8"])
def test_linear_rows_do_not_depend_on_the_batch(fmt):
    weight = random_quantized(fmt, 100, 1536).to("cuda")
    x = torch.randn(11, 1536, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(m, 100, device="cuda", dtype=torch.bfloat16) for m in (11, 1, 2, 3, 4, 5)]
    for out in outs:
        _C.ops.linear(out, x[:out.shape[0]], weight.qweight, None, **weight.kernel_args())
    for out in outs[1:]:
        assert torch.equal(out, outs[0][:out.shape[0]])


@pytest.mark.parametrize("m,n,k", [(1, 7, 64), (5, 33, 576), (16, 4096, 4096), (17, 130, 1536), (40, 9, 256)])
@pytest.mark.parametrize("fmt", QUANTIZED + ["dense"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_linear_on_tensor_cores_is_the_product_of_the_dequantized_weights(dtype, fmt, m, n, k):
    """tensor_cores=True (linear_mma.cu) against the CPU's dense kernel on the weights dequantize
    writes in the activations' dtype, with a bias."""
    weight = torch.randn(n, k).to(dtype) if fmt == "dense" else random_quantized(fmt, n, k)
    k = weight.shape[1]  # whole blocks of the format
    x, b = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    rounded = weight if fmt == "dense" else weight.dequantize(dtype)
    expected = torch.empty(m, n, dtype=dtype)
    _C.ops.linear(expected, x, rounded, b)
    w = weight.to("cuda")
    data, args = (w, {}) if fmt == "dense" else (w.qweight, w.kernel_args())
    out = torch.empty(m, n, dtype=dtype, device="cuda")
    _C.ops.linear(out, x.cuda(), data, b.cuda(), **args, tensor_cores=True)
    assert_matches_cpu(out, expected)


def test_linear_on_tensor_cores_rows_do_not_depend_on_the_batch():
    weight = random_quantized("int4", 100, 1536).to("cuda")
    x = torch.randn(33, 1536, device="cuda", dtype=torch.bfloat16)
    outs = {(first, m): torch.empty(m, 100, device="cuda", dtype=torch.bfloat16)
            for first, m in ((0, 33), (0, 1), (0, 16), (16, 3), (32, 1))}
    for (first, m), out in outs.items():
        _C.ops.linear(out, x[first:first + m], weight.qweight, None, **weight.kernel_args(), tensor_cores=True)
    for (first, m), out in outs.items():
        assert torch.equal(out, outs[0, 33][first:first + m])


@pytest.mark.parametrize("fmt", ["q4_k", "int4"])
def test_layer_takes_tensor_cores_up_to_their_row_limit(fmt, monkeypatch):
    """With CUDA_TENSOR_CORE_MAX_ROWS set, layers.linear sends 16-bit products of up to that many
    rows to the tensor-core kernel (float32 ones keep the GEMV), and more rows to the GEMM."""
    from octavo.layers import linear as layer

    monkeypatch.setattr(layer, "CUDA_TENSOR_CORE_MAX_ROWS", 16)
    calls = []
    linear_op = _C.ops.linear
    monkeypatch.setattr(layer._C.ops, "linear", lambda *args: calls.append(args[-1]) or linear_op(*args))
    weight = random_quantized(fmt, 300, 512).to("cuda")
    for m, dtype, expected_calls in ((1, torch.bfloat16, [True]), (16, torch.float16, [True]),
                                     (4, torch.float32, [False]), (17, torch.bfloat16, [])):
        calls.clear()
        x = torch.randn(m, weight.shape[1], device="cuda").to(dtype)
        got = layer.linear(x, weight)
        expected = torch.nn.functional.linear(x.double(), weight.dequantize(dtype).double())
        tolerance = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
        assert calls == expected_calls and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=tolerance,
                                   atol=tolerance * expected.abs().max().item())


def test_layer_takes_fp8_tensor_cores_from_their_row_count(monkeypatch):
    """With CUDA_FP8_GEMM_FROM_ROWS set, bfloat16 products of a per-row fp8 weight from that many
    rows run W8A8 (fp8_gemm: each row rounded to E4M3 at its own scale), against that formula in
    float64; fewer rows, float16 rows and block-wise scales keep the weight-only paths."""
    from octavo.layers import linear as layer
    from octavo.layers.quantize import quantize_fp8
    from test_fp8_weights import assert_rows_close, block_weight, w8a8_reference

    monkeypatch.setattr(layer, "CUDA_FP8_GEMM_FROM_ROWS", 16)
    per_row = quantize_fp8(torch.randn(256, 512) * torch.logspace(-2, 1, 256)[:, None])
    for weight, m, dtype, w8a8 in ((per_row, 16, torch.bfloat16, True), (per_row, 300, torch.bfloat16, True),
                                   (per_row, 15, torch.bfloat16, False), (per_row, 40, torch.float16, False),
                                   (block_weight(256, 512, 128), 40, torch.bfloat16, False)):
        x = (torch.randn(m, 512) * torch.logspace(-3, 1, m)[:, None]).to(dtype)  # float16 holds the products
        got = layer.linear(x.cuda(), copy.deepcopy(weight).to("cuda")).cpu()  # .to moves the module itself
        assert got.dtype == dtype
        if w8a8:
            assert_rows_close(got, w8a8_reference(x, weight))
        else:
            expected = x.double() @ weight.dequantize().double().T
            tolerance = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
            assert ((got.double() - expected).abs() <= tolerance * expected.abs().amax(dim=1, keepdim=True)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", ["q4_1", "int4"])
def test_layer_takes_the_kernel_for_few_rows_and_dequantized_gemm_for_many(fmt, dtype, monkeypatch):
    """Both paths of layers.linear on the GPU against the dequantized product in float64: the
    kernel up to CUDA_KERNEL_MAX_ROWS rows, above it the GEMM in slabs of 256 rows (3 slabs here,
    the last shorter) with a bias; bfloat16 multiplies the weights rounded to bfloat16."""
    from octavo.layers import linear as layer

    monkeypatch.setattr(layer, "DEQUANTIZE_SLAB_WEIGHTS", 256 * 512)
    slabs = []
    dequantize_rows = layer.QuantizedWeight.dequantize_rows
    monkeypatch.setattr(layer.QuantizedWeight, "dequantize_rows",
                        lambda self, *args: slabs.append(args) or dequantize_rows(self, *args))
    weight = random_quantized(fmt, 700, 512).to("cuda")
    bias = torch.randn(700, device="cuda").to(dtype)
    expected_weight = weight.dequantize(dtype).double()
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -7}[dtype]
    for m, slabs_used in ((layer.CUDA_KERNEL_MAX_ROWS, 0), (layer.CUDA_KERNEL_MAX_ROWS + 1, 3), (300, 3)):
        slabs.clear()
        x = torch.randn(m, 512, device="cuda").to(dtype)
        expected = torch.nn.functional.linear(x.double(), expected_weight, bias.double())
        got = layer.linear(x, weight, bias)
        assert len(slabs) == slabs_used and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=tolerance,
                                   atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer_takes_the_kernel_for_dense_weights_up_to_its_crossover(dtype, monkeypatch):
    """Dense weights on the GPU: Octavo's kernel up to CUDA_DENSE_KERNEL_MAX_ROWS rows, cuBLAS
    above and for input rows the kernel cannot read in its packs; every path against float64."""
    from octavo.layers import linear as layer

    calls = []
    linear_op = _C.ops.linear
    monkeypatch.setattr(layer._C.ops, "linear", lambda *args: calls.append(args) or linear_op(*args))
    weight = (torch.randn(300, 576) * 0.05).to(dtype).cuda()
    bias = torch.randn(300).to(dtype).cuda()
    limit = layer.CUDA_DENSE_KERNEL_MAX_ROWS[dtype]
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    padded = torch.randn(1, 577).to(dtype).cuda()
    for x, kernel in [(torch.randn(m, 576).to(dtype).cuda(), m <= limit) for m in (1, limit, limit + 1, 40)] + \
                     [(padded[:, 1:], False)]:  # rows 577 elements apart: not at 4-element boundaries
        calls.clear()
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        got = layer.linear(x, weight, bias)
        assert len(calls) == kernel and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


# ----------------------------------------------------------------------------- streams and devices

def test_ops_are_captured_in_a_cuda_graph_on_the_stream_they_are_given():
    """Inside a capture, a launch on the legacy default stream fails; on the capturing stream (set
    through set_cuda_stream) it is recorded, and the replay reads the inputs' new values."""
    x, w = torch.randn(64, 1024, device="cuda"), torch.rand(1024, device="cuda") + 0.5
    out = torch.empty_like(x)
    _C.ops.rms_norm(out, x, w, 1e-6)  # warm-up outside the capture (module loading)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
        try:
            _C.ops.rms_norm(out, x, w, 1e-6)
        finally:
            _C.set_cuda_stream(0)
    assert _C.cuda_stream() == 0
    x.copy_(torch.randn(64, 1024))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.empty(64, 1024)
    _C.ops.rms_norm(ref, x.cpu(), w.cpu(), 1e-6)
    assert_matches_cpu(out, ref)


def test_mixed_devices_are_refused():
    x = torch.randn(2, 64, device="cuda")
    with pytest.raises(ValueError, match="'weight' is on cpu:0 but 'input' is on cuda:0"):
        _C.ops.rms_norm(torch.empty_like(x), x, torch.ones(64), 1e-6)


# ----------------------------------------------------------------------------- paged_attention

def check_attention_on_gpu(batch, dtype, sliding_window=0, softcap=0.0):
    """The batch of test_attention.py (built on the CPU, NaN in every unused block) run on the GPU,
    against the same float64 reference as the CPU kernel; with the host's plan the result is the
    same to the bit as with the one laid out on the device."""
    from test_attention import TOLERANCE, rel_error

    scale = batch.query.shape[-1] ** -0.5
    plan = torch.empty(len(batch.seqs) + 1, dtype=torch.int32)
    _C.ops.plan_paged_attention(plan, batch.query_start_loc, batch.query.shape[1], batch.key_cache.shape[1])
    args = (batch.query.cuda(), batch.key_cache.cuda(), batch.value_cache.cuda(), batch.query_start_loc.cuda(),
            batch.seq_lens.cuda(), batch.block_tables.cuda(), scale, sliding_window, softcap)
    out, planned = torch.empty_like(args[0]), torch.empty_like(args[0])
    _C.ops.paged_attention(out, *args)
    _C.ops.paged_attention(planned, *args, plan=plan.cuda())
    torch.cuda.synchronize()
    out = out.cpu()
    assert torch.isfinite(out).all()
    assert rel_error(out, batch.reference(scale, sliding_window, softcap)) < TOLERANCE[dtype]
    assert torch.equal(planned.cpu(), out)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (32, 8), (16, 1)])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_mixed_batch(dtype, head_size, heads):
    from test_attention import MIXED, Batch

    gen = torch.Generator().manual_seed(head_size * 100 + heads[0])
    check_attention_on_gpu(Batch(MIXED, *heads, head_size, 16, dtype, gen), dtype)


DECODES = [(37, 1), (0, 1), (64, 1), (300, 1), (1, 1), (129, 1)]


@pytest.mark.parametrize("heads", [(6, 3), (8, 2), (12, 2), (8, 1), (16, 1)], ids=lambda h: f"group{h[0] // h[1]}")
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_decodes(dtype, head_size, heads):
    """Decodes alone: groups of 4 and more in bfloat16 / float16 take the tensor-core decode
    kernel (padded to 16 rows), smaller groups and float32 the split-KV kernel; block size 32
    and 24 (a division instead of a shift), a window and a cap."""
    from test_attention import Batch

    gen = torch.Generator().manual_seed(head_size * 10 + heads[0] * 3 + heads[1])
    check_attention_on_gpu(Batch(DECODES, *heads, head_size, 32, dtype, gen), dtype)
    batch = Batch(DECODES, *heads, head_size, 24, dtype, gen)
    check_attention_on_gpu(batch, dtype, sliding_window=50)
    batch.query *= 8  # large scores, so that the cap matters
    check_attention_on_gpu(batch, dtype, softcap=5.0)


@pytest.mark.parametrize("seqs", [[(5000, 1), (2047, 1), (10, 1)], [(5000, 1), (2047, 1), (3000, 2), (10, 1)]],
                         ids=["decodes", "with-a-chunk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_long_contexts(dtype, seqs):
    """Contexts of 2-5k tokens, GQA 4:1. Decodes alone split their keys across blocks (the
    tensor-core decode kernel in bfloat16 / float16, the split-KV kernel in float32), then merge;
    with a multi-token query, bfloat16 / float16 take the tensor-core prefill kernel."""
    from test_attention import Batch

    gen = torch.Generator().manual_seed(3)
    batch = Batch(seqs, 32, 8, 128, 16, dtype, gen)
    check_attention_on_gpu(batch, dtype)
    check_attention_on_gpu(batch, dtype, sliding_window=700)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_sliding_window_and_softcap(dtype):
    from test_attention import MIXED, Batch

    gen = torch.Generator().manual_seed(5)
    batch = Batch([(90, 1), (40, 30), (0, 50), (7, 1), (200, 130)], 8, 2, 64, 16, dtype, gen)
    check_attention_on_gpu(batch, dtype, sliding_window=24)
    check_attention_on_gpu(batch, dtype, sliding_window=1)
    capped = Batch(MIXED, 4, 2, 64, 16, dtype, gen)
    capped.query *= 8  # large scores, so that the cap matters
    check_attention_on_gpu(capped, dtype, softcap=5.0)


def test_paged_attention_refuses_what_it_has_no_kernel_for():
    from test_attention import Batch

    gen = torch.Generator().manual_seed(9)
    batch = Batch([(3, 2)], 4, 2, 80, 16, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="head_size 80 has no CUDA kernel"):
        check_attention_on_gpu(batch, torch.bfloat16)
