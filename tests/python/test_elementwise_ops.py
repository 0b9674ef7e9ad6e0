"""The CPU elementwise kernels (rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul,
gelu_and_mul) against float64 torch references on every compiled ISA, their argument checks, and
the RoPE cache builder (octavo.layers.rotary) against transformers."""

import math

import pytest
import torch
from octavo import _C
from octavo.layers.rotary import rope_cos_sin_cache, rope_dims, rope_inv_freq, rope_is_neox

try:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except ImportError:  # only the RoPE cache comparisons need it
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
# ||out - ref|| / ||ref||, ref in float64 on the same (rounded) inputs.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]:g} ({dtype})"


# ----------------------------------------------------------------------------- rms_norm

# The adapters' as_rows() flattens every dimension after the first into the row, so [B, S, hidden]
# is read as B rows of S * hidden: rms_norm then rejects the weight, and silu_and_mul silently
# pairs the wrong halves. ops.h promises "any leading shape"; until the adapters flatten the
# leading dimensions instead, these stay expected failures.
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: bool) -> torch.Tensor:
    """x: [..., hidden] float64; weight: [hidden]."""
    w = weight.double() + (1.0 if weight_offset else 0.0)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def norm_weight(hidden: int, dtype: torch.dtype, weight_offset: bool) -> torch.Tensor:
    # Gemma stores weight - 1, centered on 0; others store weights around 1.
    w = torch.randn(hidden) * 0.1 if weight_offset else torch.rand(hidden) + 0.5
    return w.to(dtype)


@pytest.mark.parametrize("weight_offset", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 17), (5, 4095), (64, 1024)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(isa, dtype, rows, hidden, weight_offset):
    x = torch.randn(rows, hidden, dtype=dtype) * 2
    w = norm_weight(hidden, dtype, weight_offset)
    out = torch.empty_like(x)
    _C.ops.rms_norm(out, x, w, 1e-6, weight_offset)
    assert_close(out, rms_norm_ref(x.double(), w, 1e-6, weight_offset), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_strided_in_place(isa, dtype):
    big = torch.randn(6, 600, dtype=dtype)
    before = big.clone()
    x = big[:, 100:333]  # rows of 233 with a row stride of 600
    w = norm_weight(233, dtype, False)
    ref = rms_norm_ref(x.double(), w, 1e-5, False)
    _C.ops.rms_norm(x, x, w, 1e-5)
    assert_close(x, ref, dtype)
    assert torch.equal(big[:, :100], before[:, :100]) and torch.equal(big[:, 333:], before[:, 333:])


def test_rms_norm_leading_dims(isa):
    x = torch.randn(2, 3, 40)
    w = norm_weight(40, torch.float32, False)
    out = torch.empty_like(x)
    _C.ops.rms_norm(out, x, w, 1e-6)
    assert_close(out, rms_norm_ref(x.double(), w, 1e-6, False), torch.float32)


@pytest.mark.parametrize("weight_offset", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 17), (5, 4095), (64, 1024)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm(isa, dtype, rows, hidden, weight_offset):
    x = torch.randn(rows, hidden, dtype=dtype)
    residual = torch.randn(rows, hidden, dtype=dtype) * 3
    w = norm_weight(hidden, dtype, weight_offset)
    # vLLM: the residual is stored in the activation dtype and normalized as stored.
    expected_residual = (x.float() + residual.float()).to(dtype)
    ref = rms_norm_ref(expected_residual.double(), w, 1e-6, weight_offset)
    _C.ops.fused_add_rms_norm(x, residual, w, 1e-6, weight_offset)
    assert torch.equal(residual, expected_residual)
    assert_close(x, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm_strided(isa, dtype):
    qkv_like = torch.randn(9, 300, dtype=dtype)
    x = qkv_like[:, 50:177]  # [9, 127], row stride 300
    residual = torch.randn(9, 2, 127, dtype=dtype)[:, 1]  # row stride 254
    w = norm_weight(127, dtype, False)
    expected_residual = (x.float() + residual.float()).to(dtype)
    ref = rms_norm_ref(expected_residual.double(), w, 1e-6, False)
    _C.ops.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_close(x, ref, dtype)


# ----------------------------------------------------------------------------- rotary_embedding


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, head_size: int, is_neox: bool):
    """x: [T, heads * head_size] float64; cache: [max_position, rot_dim]. Returns rotated x."""
    x = x.reshape(x.shape[0], -1, head_size).clone()
    rot_dim = cache.shape[1]
    half = rot_dim // 2
    cos = cache[positions.long(), :half].double()[:, None, :]
    sin = cache[positions.long(), half:].double()[:, None, :]
    first, second = (slice(0, half), slice(half, rot_dim)) if is_neox else (slice(0, rot_dim, 2), slice(1, rot_dim, 2))
    a, b = x[..., first].clone(), x[..., second].clone()
    x[..., first] = a * cos - b * sin
    x[..., second] = b * cos + a * sin
    return x.reshape(x.shape[0], -1)


def random_cache(head_size: int, rot_dim: int, max_position: int = 300) -> torch.Tensor:
    config = {"head_dim": head_size, "partial_rotary_factor": rot_dim / head_size}
    return rope_cos_sin_cache(config, max_position=max_position)


# The second shape is large enough to spread over the thread pool.
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", [(7, 4, 2), (32, 16, 4)])
@pytest.mark.parametrize("head_size,rot_dim", [(128, 128), (64, 32), (80, 40)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_embedding(isa, dtype, is_neox, head_size, rot_dim, num_tokens, num_heads, num_kv_heads):
    cache = random_cache(head_size, rot_dim)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    query, key, value = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    value_before = value.clone()
    positions = torch.randint(0, cache.shape[0], (num_tokens,), dtype=torch.int64)
    q_ref = rope_ref(query.double(), positions, cache, head_size, is_neox)
    k_ref = rope_ref(key.double(), positions, cache, head_size, is_neox)
    _C.ops.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    assert_close(query, q_ref, dtype)
    assert_close(key, k_ref, dtype)
    assert torch.equal(value, value_before)
    if rot_dim < head_size:  # partial rotary leaves the tail of every head alone
        tail = query.reshape(num_tokens, num_heads, head_size)[..., rot_dim:]
        assert torch.equal(tail.double(), q_ref.reshape(num_tokens, num_heads, head_size)[..., rot_dim:])


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_no_key_3d(isa, positions_dtype, is_neox):
    cache = random_cache(64, 64)
    query = torch.randn(5, 3, 64, dtype=torch.bfloat16)  # [T, H, D]
    positions = torch.tensor([0, 299, 17, 17, 1], dtype=positions_dtype)
    ref = rope_ref(query.reshape(5, -1).double(), positions, cache, 64, is_neox)
    _C.ops.rotary_embedding(positions, query, None, 64, cache, is_neox)
    assert_close(query.reshape(5, -1), ref, torch.bfloat16)


def test_rotary_embedding_position_zero_is_identity(isa):
    cache = random_cache(128, 128)
    query = torch.randn(3, 256)
    before = query.clone()
    _C.ops.rotary_embedding(torch.zeros(3, dtype=torch.int64), query, None, 128, cache, True)
    assert torch.equal(query, before)


# ----------------------------------------------------------------------------- gated activations


def silu_ref(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def gelu_ref(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gated_ref(x: torch.Tensor, act) -> torch.Tensor:
    """x: [rows, 2d] float64 -> act(x[:, :d]) * x[:, d:]."""
    d = x.shape[-1] // 2
    return act(x[..., :d]) * x[..., d:]


ACTIVATIONS = {
    "silu": (lambda out, x: _C.ops.silu_and_mul(out, x), silu_ref),
    "gelu": (lambda out, x: _C.ops.gelu_and_mul(out, x, "none"), lambda x: gelu_ref(x, "none")),
    "gelu_tanh": (lambda out, x: _C.ops.gelu_and_mul(out, x, "tanh"), lambda x: gelu_ref(x, "tanh")),
}


@pytest.mark.parametrize("rows,d", [(3, 17), (2, 4095), (1, 8195), (40, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_gated_activation(isa, name, dtype, rows, d):
    op, act = ACTIVATIONS[name]
    x = torch.randn(rows, 2 * d, dtype=dtype) * 3  # reaches both saturated ends
    out = torch.empty(rows, d, dtype=dtype)
    op(out, x)
    assert_close(out, gated_ref(x.double(), act), dtype)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_gated_activation_strided(isa, name):
    op, act = ACTIVATIONS[name]
    big_in = torch.randn(4, 3, 2 * 33)
    x = big_in[:, 1]  # [4, 66], row stride 198
    big_out = torch.zeros(4, 50)
    out = big_out[:, 5:38]  # [4, 33], row stride 50
    op(out, x)
    assert_close(out, gated_ref(x.double(), act), torch.float32)
    assert not big_out[:, :5].any() and not big_out[:, 38:].any()


def test_silu_saturates_like_torch(isa):
    x = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, float("inf")] * 3)[None]
    out = torch.empty_like(x)
    _C.ops.silu_and_mul(out, torch.cat([x, torch.ones_like(x)], dim=1))
    torch.testing.assert_close(out, torch.nn.functional.silu(x), rtol=1e-6, atol=1e-30)


def test_gated_activation_leading_dims(isa):
    x = torch.randn(2, 3, 20)
    out = torch.empty(2, 3, 10)
    _C.ops.silu_and_mul(out, x)
    assert_close(out, gated_ref(x.double(), silu_ref), torch.float32)


# ----------------------------------------------------------------------------- threading


@pytest.fixture
def restore_threads():
    previous = _C.get_num_threads()
    yield
    _C.set_num_threads(previous)


def run_all_ops(x: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor) -> list:
    """Every op on inputs big enough to be split over threads. x: [T, 2 * 4096] bfloat16."""
    norm_out, act_out, rotated = torch.empty_like(x), torch.empty_like(x[:, :4096]), x.clone()
    _C.ops.rms_norm(norm_out, x, torch.ones(x.shape[1], dtype=x.dtype), 1e-6)
    _C.ops.silu_and_mul(act_out, x)
    _C.ops.rotary_embedding(positions, rotated, None, 128, cache, False)
    return [norm_out, act_out, rotated]


def test_results_do_not_depend_on_thread_count(restore_threads):
    x = torch.randn(64, 8192, dtype=torch.bfloat16)
    cache, positions = random_cache(128, 128), torch.randint(0, 300, (64,))
    _C.set_num_threads(2)
    threaded = run_all_ops(x, cache, positions)
    _C.set_num_threads(1)
    serial = run_all_ops(x, cache, positions)
    for a, b in zip(threaded, serial):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- argument checks

_x = torch.randn(4, 64, dtype=torch.bfloat16)
_w = torch.ones(64, dtype=torch.bfloat16)
_cache = torch.randn(10, 32)
_pos = torch.arange(4)

BAD_CALLS = {
    "weight dtype": (TypeError, "weight", lambda: _C.ops.rms_norm(torch.empty_like(_x), _x, _w.float(), 1e-6)),
    "int input": (TypeError, "input", lambda: _C.ops.rms_norm(_x.int(), _x.int(), _w.int(), 1e-6)),
    "out shape": (ValueError, "out", lambda: _C.ops.rms_norm(torch.empty(4, 63, dtype=_x.dtype), _x, _w, 1e-6)),
    "weight size": (ValueError, "weight", lambda: _C.ops.rms_norm(torch.empty_like(_x), _x, _w[:32], 1e-6)),
    "residual shape": (
        ValueError,
        "residual",
        lambda: _C.ops.fused_add_rms_norm(_x.clone(), torch.randn(3, 64, dtype=_x.dtype), _w, 1e-6),
    ),
    "residual dtype": (TypeError, "residual", lambda: _C.ops.fused_add_rms_norm(_x.clone(), _x.float(), _w, 1e-6)),
    "position range": (
        ValueError,
        "positions",
        lambda: _C.ops.rotary_embedding(torch.tensor([0, 1, 2, 10]), _x.clone(), None, 32, _cache, True),
    ),
    "negative position": (
        ValueError,
        "positions",
        lambda: _C.ops.rotary_embedding(torch.tensor([0, -1, 2, 3]), _x.clone(), None, 32, _cache, True),
    ),
    "positions dtype": (
        TypeError,
        "positions",
        lambda: _C.ops.rotary_embedding(_pos.float(), _x.clone(), None, 32, _cache, True),
    ),
    "rot_dim > head_size": (
        ValueError,
        "cos_sin_cache",
        lambda: _C.ops.rotary_embedding(_pos, _x.clone(), None, 16, _cache, True),
    ),
    "cache dtype": (
        TypeError,
        "cos_sin_cache",
        lambda: _C.ops.rotary_embedding(_pos, _x.clone(), None, 32, _cache.double(), True),
    ),
    "key dtype": (TypeError, "key", lambda: _C.ops.rotary_embedding(_pos, _x.clone(), _x.float(), 32, _cache, True)),
    "key rows": (
        ValueError,
        "key",
        lambda: _C.ops.rotary_embedding(_pos, _x.clone(), _x[:3].clone(), 32, _cache, True),
    ),
    "partial head": (ValueError, "query", lambda: _C.ops.rotary_embedding(_pos, _x.clone(), None, 48, _cache, True)),
    "silu out shape": (ValueError, "out", lambda: _C.ops.silu_and_mul(torch.empty(4, 31, dtype=_x.dtype), _x)),
    "silu out dtype": (TypeError, "out", lambda: _C.ops.silu_and_mul(torch.empty(4, 32), _x)),
    "gelu odd input": (ValueError, "input", lambda: _C.ops.gelu_and_mul(torch.empty(4, 32), torch.randn(4, 65))),
    "gelu approximate": (
        ValueError,
        "approximate",
        lambda: _C.ops.gelu_and_mul(torch.empty_like(_x[:, :32]), _x, "fast"),
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_raise(case):
    error, argument, call = BAD_CALLS[case]
    with pytest.raises(error, match=argument):
        call()


# ----------------------------------------------------------------------------- RoPE cache vs transformers

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
}


def llama_config(scaling):
    return transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=scaling
    )


def hf_inv_freq(config, seq_len: int):
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    kwargs = {"seq_len": seq_len} if rope_type == "dynamic" else {}
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)


@needs_transformers
@pytest.mark.parametrize("name", SCALINGS)
def test_rope_inv_freq_matches_transformers(name):
    config = llama_config(SCALINGS[name])
    cache = rope_cos_sin_cache(config)
    ref, ref_factor = hf_inv_freq(config, seq_len=cache.shape[0])
    inv_freq, factor = rope_inv_freq(config, seq_len=cache.shape[0])
    torch.testing.assert_close(inv_freq, ref.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    # Every row is [cos, sin] of pos * inv_freq, scaled by the attention factor.
    positions = torch.tensor([0, 1, 7, 1000, cache.shape[0] - 1])
    angles = positions[:, None].double() * inv_freq[None, :]
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1) * factor
    torch.testing.assert_close(cache[positions].double(), expected, rtol=0, atol=1e-6)


@needs_transformers
@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "dynamic"])  # HF rescales dynamic per length
def test_rope_cache_matches_hf_rotary_embedding(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(SCALINGS[name])
    positions = torch.arange(512)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    cache = rope_cos_sin_cache(config)
    half = cache.shape[1] // 2
    torch.testing.assert_close(cache[positions, :half], cos[0, :, :half], rtol=0, atol=1e-4)
    torch.testing.assert_close(cache[positions, half:], sin[0, :, :half], rtol=0, atol=1e-4)


@needs_transformers
def test_rotary_embedding_matches_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = llama_config(SCALINGS["llama3"])
    positions = torch.randint(0, 512, (9,))
    q, k = torch.randn(1, 4, 9, 128), torch.randn(1, 2, 9, 128)  # HF layout [B, heads, T, D]
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    query = q[0].transpose(0, 1).contiguous()  # [T, heads, D]
    key = k[0].transpose(0, 1).contiguous()
    _C.ops.rotary_embedding(positions, query, key, 128, rope_cos_sin_cache(config), rope_is_neox(config))
    torch.testing.assert_close(query, q_ref[0].transpose(0, 1), rtol=0, atol=1e-4)
    torch.testing.assert_close(key, k_ref[0].transpose(0, 1), rtol=0, atol=1e-4)


@needs_transformers
def test_rope_partial_rotary_matches_transformers():
    config = transformers.PhiConfig(
        hidden_size=256,
        num_attention_heads=4,
        partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert rope_dims(config) == (64, 32)
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](config, None)
    inv_freq, _ = rope_inv_freq(config)
    torch.testing.assert_close(inv_freq, ref.double(), rtol=1e-6, atol=0)
    assert rope_cos_sin_cache(config, max_position=100).shape == (100, 32)


@needs_transformers
def test_rope_raw_config_dict():
    """config.json as read from disk: rope_scaling spelled with `type`, theta at the top level."""
    raw = {"hidden_size": 512, "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_theta": 500000.0,
           "rope_scaling": SCALINGS["yarn"]}
    inv_freq, factor = rope_inv_freq(raw)
    ref_inv_freq, ref_factor = rope_inv_freq(llama_config(SCALINGS["yarn"]))
    assert torch.equal(inv_freq, ref_inv_freq) and factor == ref_factor


@needs_transformers
def test_rope_gptj_style():
    config = transformers.GPTJConfig(n_embd=512, n_head=4, rotary_dim=32)
    assert not rope_is_neox(config)
    assert rope_dims(config) == (128, 32)
    assert rope_is_neox(llama_config(None))


def test_rope_unsupported_type_names_it():
    config = {"hidden_size": 256, "num_attention_heads": 4, "rope_scaling": {"type": "longrope", "factor": 2.0}}
    with pytest.raises(ValueError, match="longrope.*default, linear, dynamic, llama3, yarn"):
        rope_cos_sin_cache(config)


@needs_transformers
def test_rope_per_layer_type_parameters():
    """Gemma 3 style: one RoPE dict per layer type, each matching transformers."""
    config = transformers.Gemma3TextConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](config, None, layer_type="full_attention")
    inv_freq, _ = rope_inv_freq(config, layer_type="full_attention")
    torch.testing.assert_close(inv_freq, ref.double(), rtol=1e-6, atol=0)
    sliding, _ = rope_inv_freq(config, layer_type="sliding_attention")
    torch.testing.assert_close(sliding, 1.0 / 1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    with pytest.raises(ValueError, match="layer_type"):
        rope_cos_sin_cache(config)
