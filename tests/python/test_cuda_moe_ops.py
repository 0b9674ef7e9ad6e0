"""The CUDA mixture-of-experts kernels (topk_softmax, moe_align, fused_moe) against the CPU
kernels and a float64 reference, at the layer shapes of released models and in a CUDA graph.
Runs only where a GPU is present and this build carries CUDA kernels (tests/cuda_sim runs the same
kernels on the CPU everywhere)."""

import functools

import pytest
import torch
from octavo import _C
from octavo.layers.moe import fused_moe_torch
from octavo.layers.quantize import quantize

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _C.cuda_compiled(), reason="this build of Octavo has no CUDA kernels"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

ULP = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def route(tokens: int, num_experts: int, top_k: int, device="cpu"):
    weights = torch.empty(tokens, top_k, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    _C.ops.topk_softmax(weights, ids, torch.randn(tokens, num_experts, device=device), True)
    return weights, ids


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_experts,top_k,groups", [(8, 2, 0), (64, 8, 0), (128, 8, 0), (256, 8, 8), (60, 4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_picks_the_cpu_experts(dtype, num_experts, top_k, groups, scoring):
    logits = (torch.randn(333, num_experts) * 3).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        weights = torch.empty(333, top_k, device=device)
        ids = torch.empty(333, top_k, dtype=torch.int32, device=device)
        _C.ops.topk_softmax(weights, ids, logits.to(device), True, scoring, num_expert_group=groups,
                            topk_group=groups // 2 if groups else 0)
        results.append((weights.cpu(), ids.cpu()))
    (cpu_w, cpu_ids), (gpu_w, gpu_ids) = results
    assert torch.equal(gpu_ids, cpu_ids)
    torch.testing.assert_close(gpu_w, cpu_w, rtol=1e-5, atol=1e-6)  # CUDA's expf / tanhf differ by ulps


@pytest.mark.parametrize("pairs_shape,num_experts,block_size", [((1, 8), 128, 16), ((4096, 8), 128, 64),
                                                                ((37, 2), 8, 4), ((512, 6), 64, 1)])
def test_moe_align_gives_the_cpu_layout(pairs_shape, num_experts, block_size):
    ids = torch.randint(-1, num_experts, pairs_shape, dtype=torch.int32)
    capacity = ids.numel() + num_experts * (block_size - 1)
    results = []
    for device in ("cpu", "cuda"):
        sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
        experts = torch.empty(capacity // block_size, dtype=torch.int32, device=device)
        used = torch.empty(1, dtype=torch.int32, device=device)
        _C.ops.moe_align(ids.to(device), num_experts, block_size, sorted_ids, experts, used)
        results.append([t.cpu() for t in (sorted_ids, experts, used)])
    for cpu, gpu in zip(*results):
        assert torch.equal(gpu, cpu)


def stack(w: torch.Tensor, fmt: str, prefix: str) -> tuple[dict, torch.Tensor]:
    """The op's arguments for an [E, N, K] stack on the GPU in `fmt`, and the float64 weights they
    stand for."""
    if fmt == "dense":
        return {prefix: w}, w.double()
    e, n, k = w.shape
    q = quantize(w.float().reshape(e * n, k), fmt)
    args = {prefix: q.qweight.view(e, n, -1), f"{prefix}_format": fmt, f"{prefix}_group_size": q.group_size,
            f"{prefix}_scales": q.scales.view(e, n, *q.scales.shape[1:])}
    if q.zeros is not None:
        args[f"{prefix}_zeros"] = q.zeros.view(e, n, *q.zeros.shape[1:])
    floats = torch.empty(e * n, k, device=w.device)
    _C.ops.dequantize(floats, q.qweight, fmt, q.scales, q.zeros, q.group_size)
    return args, floats.view(e, n, k).double()


# Layer shapes: Mixtral-8x7B's experts at a quarter of their width (memory), Qwen3-30B-A3B's and
# OLMoE's whole: experts, top-k, hidden, width.
SHAPES = {"mixtral/4": (8, 2, 4096, 3584), "qwen3": (128, 8, 2048, 768), "olmoe": (64, 8, 2048, 1024)}


@functools.lru_cache(maxsize=1)
def layer(dtype, shape: str, fmt: str):
    """One layer's stacks, made on the GPU once for all the token counts."""
    num, _, hidden, width = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(7)
    w13 = (torch.randn(num, 2 * width, hidden, device="cuda", generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num, hidden, width, device="cuda", generator=gen) / width ** 0.5).to(dtype)
    return stack(w13, fmt, "w13"), stack(w2, fmt, "w2")


def takes_tensor_cores(pairs: int, num: int, fmt: str) -> bool:
    """moe.cu's mma_pays: a block of 64 pairs, or 2 pairs per expert (4 for quantized experts)."""
    return pairs >= 64 or pairs >= (2 if fmt == "dense" else 4) * min(num, pairs)


@pytest.mark.parametrize("tokens", [1, 7, 64, 600])
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_matches_the_float64_product(dtype, shape, fmt, tokens):
    num, top_k, hidden, width = SHAPES[shape]
    (a, w13), (b, w2) = layer(dtype, shape, fmt)
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    weights, ids = route(tokens, num, top_k, "cuda")
    ids[0, 0] = -1  # an expert on another rank
    out = torch.empty_like(x)
    _C.ops.fused_moe(out, x, topk_weights=weights, topk_ids=ids, **a, **b)
    want = fused_moe_torch(x.double(), w13.view(-1, hidden), w2.view(-1, width), weights.double(), ids, num)
    # Batches of 16-bit activations with enough pairs run on tensor cores, which round weights and
    # activation to 16 bits; the others keep float32 to the end.
    tensor_cores = dtype != torch.float32 and takes_tensor_cores(tokens * top_k, num, fmt)
    atol = (ULP[dtype] if tensor_cores else 2.0 ** -16) * want.abs().max().item()
    torch.testing.assert_close(out.double(), want, rtol=ULP[dtype], atol=atol)


def test_fused_moe_runs_in_a_cuda_graph():
    """Its workspace, grown by a first call, is reused inside the capture; replays follow new
    routings copied into the captured buffers."""
    num, top_k, hidden, width, tokens = 64, 8, 512, 256, 16
    w13 = torch.randn(num, 2 * width, hidden, device="cuda") / hidden ** 0.5
    w2 = torch.randn(num, hidden, width, device="cuda") / width ** 0.5
    x = torch.randn(tokens, hidden, device="cuda")
    weights, ids = route(tokens, num, top_k, "cuda")
    out = torch.empty_like(x)
    run = lambda: _C.ops.fused_moe(out, x, w13, w2, topk_weights=weights, topk_ids=ids)  # noqa: E731
    run()  # outside the capture: grows the workspace, loads the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
        try:
            run()
        finally:
            _C.set_cuda_stream(0)
    new_weights, new_ids = route(tokens, num, top_k, "cuda")
    weights.copy_(new_weights), ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.empty_like(x)
    _C.ops.fused_moe(want, x, w13, w2, topk_weights=new_weights, topk_ids=new_ids)
    assert torch.equal(out, want)


def test_cuda_refusals_name_what_is_wrong():
    x = torch.randn(2, 48, device="cuda")
    w13, w2 = torch.randn(2, 64, 48, device="cuda"), torch.randn(2, 48, 32, device="cuda")
    weights, ids = route(2, 2, 1, "cuda")
    with pytest.raises(ValueError, match="multiples of 32"):
        _C.ops.fused_moe(torch.empty_like(x), x, w13, w2, topk_weights=weights, topk_ids=ids)
    with pytest.raises(ValueError, match="argument 'topk_ids'"):
        _C.ops.fused_moe(torch.empty_like(x), x, w13, w2, topk_weights=weights, topk_ids=ids.cpu())
