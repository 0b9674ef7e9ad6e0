"""The mixture-of-experts ops: ``topk_softmax`` (the router), ``moe_align`` (pairs grouped by
expert) and ``fused_moe`` (the experts' MLP), against float64 references on every compiled ISA;
``fused_moe`` on quantized experts bit-exact against the dense op on the dequantized weights."""

import pytest
import torch
import torch.nn.functional as F

from octavo import _C
from octavo.layers.moe import fused_moe_torch
from octavo.layers.linear import QuantizedWeight, linear
from octavo.layers.quantize import quantize_int4, quantize_int8
from test_elementwise_ops import DTYPE_IDS, DTYPES
from test_linear import TOLERANCE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(5)


# ----------------------------------------------------------------------------- topk_softmax

def reference_topk(logits, k, renormalize=False, scoring="softmax", groups=0, topk_group=0, softcap=0.0):
    x = logits.double()
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    scores = x.softmax(-1) if scoring == "softmax" else x.sigmoid()
    if groups:
        best = scores.view(scores.shape[0], groups, -1).amax(-1)
        chosen = best.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
        scores = scores.masked_fill(~kept.repeat_interleave(scores.shape[1] // groups, 1), -1.0)
    weights, ids = scores.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def route(logits, k, **kwargs):
    weights = torch.full((logits.shape[0], k), float("nan"))
    ids = torch.full((logits.shape[0], k), -7, dtype=torch.int32)
    _C.ops.topk_softmax(weights, ids, logits, **kwargs)
    return weights, ids


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (7, 64, 8), (100, 128, 8), (3, 60, 4), (5, 1, 1)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_matches_float64(isa, dtype, tokens, experts, k, scoring, renormalize):
    logits = (torch.randn(tokens, experts) * 3).to(dtype)
    weights, ids = route(logits, k, renormalize=renormalize, scoring=scoring)
    ref_weights, ref_ids = reference_topk(logits, k, renormalize, scoring)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups,topk_group,k", [(8, 3, 6), (4, 1, 2), (16, 16, 8)])
def test_grouped_topk_picks_only_the_best_groups(isa, groups, topk_group, k):
    logits = torch.randn(33, 64) * 2
    weights, ids = route(logits, k, renormalize=True, scoring="sigmoid", num_expert_group=groups, topk_group=topk_group)
    ref_weights, ref_ids = reference_topk(logits, k, True, "sigmoid", groups, topk_group)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-6)
    for row in ids.long() // (64 // groups):  # every token's experts lie in at most topk_group groups
        assert row.unique().numel() <= topk_group


def test_softcap_and_ties(isa):
    logits = torch.randn(9, 16) * 40
    weights, ids = route(logits, 3, softcap=30.0)
    ref_weights, ref_ids = reference_topk(logits, 3, softcap=30.0)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-7)
    _, ids = route(torch.zeros(2, 6), 3)  # all equal: the lowest ids, in order
    assert ids.tolist() == [[0, 1, 2]] * 2
    _, ids = route(torch.full((1, 4), float("nan")), 2)  # no number to rank: still valid, distinct ids
    assert sorted(ids[0].tolist()) == [0, 1]


def test_topk_refuses_bad_arguments():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\]"):
        route(logits, 9)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        route(logits, 5, num_expert_group=4, topk_group=2)
    with pytest.raises(ValueError, match="num_expert_group 3 must divide"):
        route(logits, 2, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="topk_group must be in"):
        route(logits, 2, num_expert_group=4, topk_group=5)
    with pytest.raises(ValueError, match="scoring must be"):
        route(logits, 2, scoring="relu")
    with pytest.raises(ValueError, match="softcap must be"):
        route(logits, 2, softcap=float("inf"))
    with pytest.raises(TypeError, match="'topk_ids' must have dtype int32"):
        _C.ops.topk_softmax(torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int64), logits)
    with pytest.raises(ValueError, match="'topk_weights'"):
        _C.ops.topk_softmax(torch.empty(3, 2), torch.empty(4, 2, dtype=torch.int32), logits)


# ----------------------------------------------------------------------------- moe_align

def align(ids, experts, block):
    pairs = ids.numel()
    capacity = pairs + experts * (block - 1)
    sorted_ids = torch.full((capacity,), -5, dtype=torch.int32)
    expert_ids = torch.full((capacity // block,), -5, dtype=torch.int32)
    used = torch.zeros(1, dtype=torch.int32)
    _C.ops.moe_align(ids, experts, block, sorted_ids, expert_ids, used)
    return sorted_ids, expert_ids, int(used)


@pytest.mark.parametrize("tokens,k,experts,block", [(1, 1, 1, 1), (5, 2, 8, 4), (64, 8, 128, 16), (33, 6, 7, 64)])
def test_moe_align_groups_pairs_by_expert_in_padded_blocks(tokens, k, experts, block):
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)]).int()
    ids[0, 0] = -1  # an expert another rank holds: left out
    sorted_ids, expert_ids, used = align(ids, experts, block)
    flat, pad = ids.flatten(), tokens * k
    assert used % block == 0 and (sorted_ids[used:] == pad).all() and (expert_ids[used // block:] == -1).all()
    position = 0
    for e in range(experts):
        mine = (flat == e).nonzero().squeeze(1).int()
        padded = -(-mine.numel() // block) * block
        run = sorted_ids[position:position + padded]
        assert torch.equal(run[:mine.numel()], mine) and (run[mine.numel():] == pad).all()
        assert (expert_ids[position // block:(position + padded) // block] == e).all()
        position += padded
    assert position == used


def test_moe_align_refuses_ids_outside_the_experts():
    with pytest.raises(IndexError, match=r"holds expert 8, outside \[0, 8\)"):
        align(torch.tensor([[1, 8]], dtype=torch.int32), 8, 4)
    with pytest.raises(ValueError, match="'sorted_token_ids' must have size 8"):
        _C.ops.moe_align(torch.zeros(1, 2, dtype=torch.int32), 2, 4, torch.empty(4, dtype=torch.int32),
                         torch.empty(2, dtype=torch.int32), torch.empty(1, dtype=torch.int32))


# ----------------------------------------------------------------------------- fused_moe

def experts(num, hidden, intermediate, dtype=torch.float32):
    w13 = torch.randn(num, 2 * intermediate, hidden) / hidden**0.5
    w2 = torch.randn(num, hidden, intermediate) / intermediate**0.5
    return w13.to(dtype), w2.to(dtype)


def routing(tokens, num, k):
    weights, ids = route(torch.randn(tokens, num), k, renormalize=True)
    return weights, ids


def reference_moe(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e < 0:
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, s]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def run_moe(x, w13, w2, weights, ids, **quant):
    out = torch.full_like(x, float("nan"))
    _C.ops.fused_moe(out, x, w13, w2, weights, ids, **quant)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,num,k,hidden,intermediate", [
    (1, 8, 2, 64, 96), (6, 4, 2, 128, 32), (40, 16, 4, 96, 64), (300, 8, 2, 64, 48), (9, 3, 3, 40, 20)])
def test_fused_moe_matches_float64(isa, dtype, tokens, num, k, hidden, intermediate):
    w13, w2 = experts(num, hidden, intermediate, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    weights, ids = routing(tokens, num, k)
    out = run_moe(x, w13, w2, weights, ids)
    ref = reference_moe(x, w13, w2, weights, ids)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOLERANCE[dtype] * (1 if dtype == torch.float32 else 4), err  # 16 bits: two roundings inside
    torch.testing.assert_close(out, fused_moe_torch(x, w13, w2, weights, ids, num),
                               **({} if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)))


def test_fused_moe_skips_absent_experts_and_keeps_rows_batch_invariant(isa):
    w13, w2 = experts(6, 64, 32)
    x = torch.randn(7, 64)
    weights, ids = routing(7, 6, 2)
    ids[2, 1] = -1  # held by another rank: adds nothing
    out = run_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), reference_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)
    for t in range(7):  # each token alone gets the bits it got in the batch
        assert torch.equal(run_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])[0], out[t])
    ids[2] = -1
    assert torch.equal(run_moe(x, w13, w2, weights, ids)[2], torch.zeros(64))


def _quantized_stack(w: torch.Tensor, method: str):
    """[E, N, K] floats -> the op's quantized arguments and the dequantized [E, N, K] floats."""
    e, n, k = w.shape
    flat = w.reshape(e * n, k)
    if method in ("int8", "int4"):
        q = quantize_int8(flat) if method == "int8" else quantize_int4(flat, 32)
    else:
        from test_linear_gguf import dequantized, quantized
        blocks = quantized(e * n, k, method)
        q = QuantizedWeight(blocks, method, k)
        assert torch.equal(q.dequantize(), dequantized(blocks, method))
    stack = lambda t: None if t is None else t.view(e, n, *t.shape[1:])  # noqa: E731
    args = dict(weight=stack(q.qweight), format=q.weight_format, scales=stack(q.scales), zeros=stack(q.zeros),
                group_size=q.group_size)
    return args, q.dequantize().view(e, n, k)


@pytest.mark.parametrize("method", ["int8", "int4", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_quantized_experts_equal_the_dense_op_on_their_floats(isa, method, tokens):
    if method.startswith("q"):
        pytest.importorskip("gguf")
    w13, w2 = experts(4, 64, 96)
    a, w13_floats = _quantized_stack(w13, method)
    b, w2_floats = _quantized_stack(w2, method)
    x = torch.randn(tokens, 64)
    weights, ids = routing(tokens, 4, 2)
    out = run_moe(x, a["weight"], b["weight"], weights, ids,
                  **{f"w13_{key}": a[key] for key in ("format", "scales", "zeros", "group_size")},
                  **{f"w2_{key}": b[key] for key in ("format", "scales", "zeros", "group_size")})
    assert torch.equal(out, run_moe(x, w13_floats, w2_floats, weights, ids))


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_int4_a8_experts_equal_their_linear_calls(isa, tokens, group):
    """W4A8 experts: each expert's projections are one int4_a8 `linear` call on the rows routed to
    it (inputs rounded to int8 per group; a float path differs far beyond the bound; at 70 tokens
    an expert has 35 rows, and with groups of 64 the AMX level multiplies them on int8 tiles), and
    a token's expert outputs are added in ascending expert order."""
    w13, w2 = experts(4, 128, 192)
    a13, b2 = (quantize_int4(w.reshape(-1, w.shape[2]), group, weight_format="int4_a8") for w in (w13, w2))
    stack = lambda t, n: t.view(4, n, *t.shape[1:])  # noqa: E731
    quant = {f"{p}_{key}": value for p, q, n in (("w13", a13, 384), ("w2", b2, 128))
             for key, value in (("format", "int4_a8"), ("scales", stack(q.scales, n)), ("zeros", stack(q.zeros, n)),
                                ("group_size", group))}
    x = torch.randn(tokens, 128)
    weights, ids = routing(tokens, 4, 2)
    out = run_moe(x, stack(a13.qweight, 384), stack(b2.qweight, 128), weights, ids, **quant)
    part = lambda q, e, n: QuantizedWeight(q.qweight[e * n:(e + 1) * n], "int4_a8", q.shape[1],  # noqa: E731
                                           q.scales[e * n:(e + 1) * n], q.zeros[e * n:(e + 1) * n], group)
    acc = experts_by_linear(x, [part(a13, e, 384) for e in range(4)], [part(b2, e, 128) for e in range(4)],
                            weights, ids)
    # The op's weighted sum may fuse its multiply-adds (the vector levels): an ulp apart at most.
    torch.testing.assert_close(out, acc, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_int8_a8_experts_equal_their_linear_calls(isa, tokens, dtype):
    """W8A8 experts: each expert's projections are one int8_a8 `linear` call on the rows routed to
    it (each row rounded to int8 with its own scale; from 4 rows on int8 tiles at the AMX level).
    bfloat16 activations stay bfloat16 from 32 rows per expert on average (70 tokens), as a
    bfloat16 model's would; fewer compute in float32."""
    w13, w2 = experts(4, 128, 192)
    a13, b2 = (quantize_int8(w.reshape(-1, w.shape[2]), weight_format="int8_a8") for w in (w13, w2))
    stack = lambda t, n: t.view(4, n, *t.shape[1:])  # noqa: E731
    quant = {f"{p}_{key}": value for p, q, n in (("w13", a13, 384), ("w2", b2, 128))
             for key, value in (("format", "int8_a8"), ("scales", stack(q.scales, n)))}
    x = torch.randn(tokens, 128).to(dtype)
    weights, ids = routing(tokens, 4, 2)
    out = run_moe(x, stack(a13.qweight, 384), stack(b2.qweight, 128), weights, ids, **quant)
    part = lambda q, e, n: QuantizedWeight(q.qweight[e * n:(e + 1) * n], "int8_a8", q.shape[1],  # noqa: E731
                                           scales=q.scales[e * n:(e + 1) * n])
    compute = x if tokens == 70 else x.float()
    acc = experts_by_linear(compute, [part(a13, e, 384) for e in range(4)], [part(b2, e, 128) for e in range(4)],
                            weights, ids)
    torch.testing.assert_close(out, acc.to(dtype), rtol=1e-6, atol=1e-6)


def experts_by_linear(x, w13, w2, weights, ids):
    """The MoE layer as one `linear` call per expert and projection on the rows routed to it (w13,
    w2: each expert's QuantizedWeight), in x's dtype, each token's expert outputs added in float32 in
    ascending expert order."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(len(w13)):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if len(rows) == 0:
            continue
        gate_up = linear(x[rows], w13[e])
        act = torch.empty(len(rows), gate_up.shape[1] // 2, dtype=x.dtype)
        _C.ops.silu_and_mul(act, gate_up)
        y = linear(act, w2[e]).float()
        for j in range(len(rows)):
            acc[rows[j]] += weights[rows[j], slots[j]] * y[j]
    return acc


def test_fused_moe_refuses_bad_arguments():
    w13, w2 = experts(4, 64, 32)
    x, (weights, ids) = torch.randn(3, 64), routing(3, 4, 2)
    out = torch.empty_like(x)
    with pytest.raises(IndexError, match=r"holds expert 4, outside \[0, 4\)"):
        run_moe(x, w13, w2, weights, torch.full_like(ids, 4))
    with pytest.raises(ValueError, match="'w2' must have 64 rows per expert"):
        run_moe(x, w13, w2[:, :32].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="'w13' must hold gate and up rows"):
        run_moe(x, w13[:, :63].contiguous(), w2, weights, ids)
    with pytest.raises(ValueError, match="size 4"):
        run_moe(x, w13, w2[:3], weights, ids)
    with pytest.raises(TypeError, match="dtype of 'hidden_states'"):
        run_moe(x, w13.double(), w2, weights, ids)
    with pytest.raises(ValueError, match="must not overlap"):
        _C.ops.fused_moe(x, x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="'topk_ids' must have size 3"):
        _C.ops.fused_moe(out, x, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="int8 needs scales"):
        _C.ops.fused_moe(out, x, w13.to(torch.int8), w2, weights, ids, w13_format="int8")


@pytest.mark.parametrize("method", ["int8", "int4", "q4_0"])
def test_quantized_experts_with_bf16_activations(isa, method):
    """Few rows per expert compute in float32 (the bits of a float32 call, rounded once); from 32
    rows per expert on, each expert's weights are dequantized to bfloat16 and multiplied as a
    bfloat16 checkpoint's would be (the bits of the dense op on those weights). int8 on AMX from 4
    rows instead keeps its weights and bfloat16 inputs (linear's bf16 tiles), as `linear` would."""
    if method.startswith("q"):
        pytest.importorskip("gguf")
    w13, w2 = experts(4, 64, 96)
    a, w13_floats = _quantized_stack(w13, method)
    b, w2_floats = _quantized_stack(w2, method)
    quant = {**{f"w13_{key}": a[key] for key in ("format", "scales", "zeros", "group_size")},
             **{f"w2_{key}": b[key] for key in ("format", "scales", "zeros", "group_size")}}
    for tokens, k in ((5, 2), (70, 2)):  # 2.5 and 35 rows per expert
        x = torch.randn(tokens, 64).bfloat16()
        weights, ids = routing(tokens, 4, k)
        out = run_moe(x, a["weight"], b["weight"], weights, ids, **quant)
        if tokens == 5:
            expected = run_moe(x.float(), a["weight"], b["weight"], weights, ids, **quant).bfloat16()
        elif method == "int8" and _C.cpu_isa() == "amx":
            part = lambda w, e: QuantizedWeight(w["weight"][e], "int8", w["weight"].shape[2], w["scales"][e])  # noqa: E731
            acc = experts_by_linear(x, [part(a, e) for e in range(4)], [part(b, e) for e in range(4)], weights, ids)
            # The op's weighted sum may fuse its multiply-adds: an ulp of float32 apart, so that
            # rounding to bfloat16 may rarely land an ulp apart too.
            torch.testing.assert_close(out, acc.bfloat16(), rtol=2**-7, atol=0)
            assert (out == acc.bfloat16()).float().mean() > 0.99
            continue
        else:
            expected = run_moe(x, w13_floats.bfloat16(), w2_floats.bfloat16(), weights, ids)
        assert torch.equal(out, expected)
