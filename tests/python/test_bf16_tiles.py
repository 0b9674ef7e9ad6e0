"""Weight format "bf16_tiles" (bfloat16 weights packed once into AMX weight tiles): the packing is
exact, ``linear`` on it matches float64 on every compiled ISA and is batch invariant on each side
of its switches, and a model packed at load computes what the dense one does."""

import math

import pytest
import torch
from octavo import _C
from octavo.layers import bf16_tiles, linear as linear_layer
from octavo.layers.linear import QuantizedWeight, linear

from test_linear import assert_close, reference

# On the amx level, fewer rows than this take the vector kernel over the packed weight, more the
# AMX tiles (linear_amx.h's kPackedFromRows).
PACKED_FROM_ROWS = 8


def packed(w: torch.Tensor) -> torch.Tensor:
    data = torch.empty(w.shape[0], w.shape[1] * 2, dtype=torch.uint8)
    _C.ops.pack_bf16_tiles(data, w)
    return data


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(11)


@pytest.mark.parametrize("n,k", [(32, 32), (64, 96), (960, 576)])
def test_dequantize_gives_the_weight_back_bit_for_bit(n, k):
    w = torch.randn(n, k).bfloat16()
    w[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    data = packed(w)
    assert not torch.equal(data.view(torch.bfloat16).view(n, k), w)  # the layout did change
    for dtype in (torch.bfloat16, torch.float32):
        back = torch.empty(n, k, dtype=dtype)
        _C.ops.dequantize(back, data, "bf16_tiles")
        assert torch.equal(back.view(torch.int32) if dtype == torch.float32 else back.view(torch.int16),
                           w.to(dtype).view(torch.int32) if dtype == torch.float32 else w.view(torch.int16))


def test_layout_puts_pairs_of_inputs_per_feature_in_tile_rows():
    # Weight (n, k) = n * 1000 + k, exact in float32; read the layout back from the bytes.
    n_, k_ = 64, 64
    w = (torch.arange(n_)[:, None] * 1000 + torch.arange(k_)[None, :]).float()
    data = packed(w.bfloat16()).view(torch.bfloat16).reshape(-1).float()
    expected = w.bfloat16().float()
    # Panel 1 (rows 32..63), input block 1 (k 32..63), second tile (rows 48..63): tile row 3 holds
    # pairs (k = 32 + 6, 32 + 7) of features 48..63.
    tile = data[32 * k_ + (1 * 2 + 1) * 512:][:512].view(16, 16, 2)
    assert torch.equal(tile[3, :, 0], expected[48:64, 38])
    assert torch.equal(tile[3, :, 1], expected[48:64, 39])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 576), (64, 1536)])
def test_linear_on_packed_weights_matches_float64(isa, m, n, k):
    x = torch.randn(m, k + 64).bfloat16()[:, 32:k + 32]  # row-strided input
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    out = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16)
    _C.ops.linear(out[:, 8:], x, packed(w), b, "bf16_tiles")
    assert_close(out[:, 8:], reference(x, w, b), torch.bfloat16)
    assert out[:, :8].isnan().all()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    _C.ops.linear(out, x, packed(w), None, "bf16_tiles")
    assert_close(out, reference(x, w, None), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_activation_dtypes_read_the_packed_weight_too(isa, dtype):
    x, w = torch.randn(5, 64), torch.randn(32, 64).bfloat16()
    out = torch.empty(5, 32, dtype=dtype)
    _C.ops.linear(out, x.to(dtype), packed(w), None, "bf16_tiles")
    assert_close(out, reference(x.to(dtype), w, None), dtype)


def test_each_row_is_the_same_whatever_the_batch(isa):
    x, w = torch.randn(300, 576).bfloat16(), torch.randn(704, 576).bfloat16()
    data = packed(w)
    batch = torch.empty(300, 704, dtype=torch.bfloat16)
    _C.ops.linear(batch, x, data, None, "bf16_tiles")
    assert_close(batch, reference(x, w, None), torch.bfloat16)
    for i in (0, 5, 36, 111, 299):
        rows = {}
        for size in (1, 3, 5, PACKED_FROM_ROWS, PACKED_FROM_ROWS + 9):
            start = min(i, 300 - size)
            out = torch.empty(size, 704, dtype=torch.bfloat16)
            _C.ops.linear(out, x[start:start + size], data, None, "bf16_tiles")
            rows[size] = out[i - start]
        assert torch.equal(rows[1], rows[3]) and torch.equal(rows[1], rows[5])
        assert torch.equal(rows[PACKED_FROM_ROWS], rows[PACKED_FROM_ROWS + 9])
        assert torch.equal(rows[PACKED_FROM_ROWS], batch[i])


def test_bad_arguments_are_named():
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(ValueError, match="multiples of 32"):
        _C.ops.pack_bf16_tiles(torch.empty(48, 128, dtype=torch.uint8), torch.randn(48, 64).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        _C.ops.pack_bf16_tiles(torch.empty(64, 128, dtype=torch.uint8), w.float())
    with pytest.raises(ValueError, match="out"):
        _C.ops.pack_bf16_tiles(torch.empty(64, 64, dtype=torch.uint8), w)
    with pytest.raises(ValueError, match="out_features divisible by 32"):
        _C.ops.linear(torch.empty(1, 48, dtype=torch.bfloat16), torch.randn(1, 64).bfloat16(),
                      torch.empty(48, 128, dtype=torch.uint8), None, "bf16_tiles")
    with pytest.raises(ValueError, match="bf16_tiles"):
        _C.ops.linear(torch.empty(1, 64, dtype=torch.bfloat16), torch.randn(1, 64).bfloat16(), packed(w), None,
                      "bf16_tile")


def test_quantized_weight_holds_a_packed_weight():
    w = torch.randn(64, 96).bfloat16()
    q = bf16_tiles.pack(w)
    assert isinstance(q, QuantizedWeight) and q.shape == (64, 96) and q.weight_format == "bf16_tiles"
    assert torch.equal(q.dequantize(torch.bfloat16), w)
    x = torch.randn(3, 96).bfloat16()
    assert_close(linear(x, q), reference(x, w, None), torch.bfloat16)


def test_packable_needs_bfloat16_sides_of_32():
    assert bf16_tiles.packable(torch.zeros(64, 32, dtype=torch.bfloat16))
    assert not bf16_tiles.packable(torch.zeros(48, 32, dtype=torch.bfloat16))
    assert not bf16_tiles.packable(torch.zeros(64, 48, dtype=torch.bfloat16))
    assert not bf16_tiles.packable(torch.zeros(64, 32))


def test_packing_is_chosen_only_where_torch_never_wins(monkeypatch):
    class Model:
        dtype = torch.bfloat16

    monkeypatch.setitem(linear_layer.TORCH_FROM_ROWS, torch.bfloat16, math.inf)
    assert bf16_tiles.worth_packing(Model()) == (_C.cpu_isa() == "amx")
    monkeypatch.setenv("OCTAVO_BF16_TILES", "0")
    assert not bf16_tiles.worth_packing(Model())
    monkeypatch.delenv("OCTAVO_BF16_TILES")
    monkeypatch.setitem(linear_layer.TORCH_FROM_ROWS, torch.bfloat16, 64)
    assert not bf16_tiles.worth_packing(Model())


@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_model_computes_what_the_dense_one_does(tmp_path, tied):
    from octavo.loader import load_model
    from test_models import attach_kv_cache, step, tiny_checkpoint

    tiny_checkpoint("llama", tmp_path, vocab_size=320, tie_word_embeddings=tied)
    dense, model = (load_model(tmp_path, dtype="bfloat16") for _ in range(2))
    weights = model.matmul_weights()
    assert bf16_tiles.pack_model(model) == len(weights) == 2 * 4 + 1  # 4 per layer, the LM head
    assert all(getattr(m, a).weight_format == "bf16_tiles" for m, a, _ in weights)
    assert isinstance(model.embed_tokens, torch.nn.Parameter)  # a tied embedding stays a table
    tokens = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = []
    for m in (dense, model):
        attach_kv_cache(m, num_blocks=8)
        logits.append(torch.cat([step(m, tokens[:20], 0), step(m, tokens[20:], 20)]))
    assert_close(logits[1], logits[0].double(), torch.bfloat16)


def test_the_engine_packs_where_it_pays(tmp_path, monkeypatch):
    from octavo import LLM, SamplingParams
    from test_models import tiny_checkpoint

    tiny_checkpoint("llama", tmp_path, vocab_size=320)
    monkeypatch.setattr(bf16_tiles, "worth_packing", lambda model: True)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True)
    assert llm.apply_model(lambda m: m.lm_head.weight_format)[0] == "bf16_tiles"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [9, 10, 11, 12] * 9], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
