"""reshape_and_cache and paged_attention against float64 references, on every CPU ISA level."""
import math

import pytest
import torch

from octavo import _C
from octavo.kv_cache import empty_kv_cache

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x / scale as an fp8 KV cache holds it: E4M3, nearest even, saturated at +-448 (vLLM's)."""
    x = x.float()
    # A true division as the kernels' (torch divides by a Python number as a product with its reciprocal).
    return (x / torch.full_like(x, scale)).clamp(-448, 448).to(torch.float8_e4m3fn)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


class Batch:
    """A paged KV cache holding a random context per sequence, and the queries of one step.

    seqs: (context tokens already cached, new query tokens) per sequence. Blocks are handed out
    in a shuffled order so that block tables are not the identity.
    """

    def __init__(self, seqs, num_heads, num_kv_heads, head_size, block_size, dtype, gen, cache_dtype=None,
                 kv_scales=(1.0, 1.0)):
        self.seqs, self.block_size, self.kv_scales = seqs, block_size, kv_scales
        self.seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
        blocks_per_seq = [math.ceil(int(l) / block_size) for l in self.seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN: a stray read would show
        order = torch.randperm(num_blocks - 1, generator=gen) + 1
        width = max(blocks_per_seq) + 1
        self.block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        used = 0
        for b, n in enumerate(blocks_per_seq):
            self.block_tables[b, :n] = order[used:used + n]
            used += n
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        # A cache of another dtype than the query (an engine's kv_cache_dtype) holds K and V rounded to it.
        self.key_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype)
        self.value_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype)
        total = int(self.seq_lens.sum())
        self.keys = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
        self.values = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
        k_scale, v_scale = kv_scales
        _C.ops.reshape_and_cache(self.keys, self.values, self.key_cache, self.value_cache, self.all_slots(),
                                 k_scale=k_scale, v_scale=v_scale)
        n_q = [n for _, n in seqs]
        self.query_start_loc = torch.tensor([0] + n_q, dtype=torch.int32).cumsum(0).to(torch.int32)
        self.query = torch.randn(sum(n_q), num_heads, head_size, generator=gen).to(dtype)

    def slots(self, b: int) -> torch.Tensor:
        pos = torch.arange(int(self.seq_lens[b]))
        return self.block_tables[b, pos // self.block_size].long() * self.block_size + pos % self.block_size

    def all_slots(self) -> torch.Tensor:
        return torch.cat([self.slots(b) for b in range(len(self.seqs))])

    def run(self, scale, sliding_window=0, softcap=0.0, num_decodes=0):
        out = torch.empty_like(self.query)
        _C.ops.paged_attention(out, self.query, self.key_cache, self.value_cache, self.query_start_loc,
                               self.seq_lens, self.block_tables, scale, sliding_window, softcap,
                               num_decodes=num_decodes, k_scale=self.kv_scales[0], v_scale=self.kv_scales[1])
        return out

    def stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """What the cache holds of x, as float64: rounded to its dtype (fp8: x / scale, saturated)."""
        if self.key_cache.dtype != torch.float8_e4m3fn:
            return x.to(self.key_cache.dtype).double()
        return fp8(x, scale).double() * scale

    def reference(self, scale, sliding_window=0, softcap=0.0):
        out = torch.zeros(self.query.shape, dtype=torch.float64)
        group = self.query.shape[1] // self.keys.shape[1]
        start = 0
        for b, (_, n_q) in enumerate(self.seqs):
            length = int(self.seq_lens[b])
            k = self.stored(self.keys[start:start + length], self.kv_scales[0]).repeat_interleave(group, dim=1)
            v = self.stored(self.values[start:start + length], self.kv_scales[1]).repeat_interleave(group, dim=1)
            start += length
            q0, q1 = int(self.query_start_loc[b]), int(self.query_start_loc[b + 1])
            s = torch.einsum("qhd,khd->hqk", self.query[q0:q1].double(), k) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            qpos = torch.arange(length - n_q, length)[:, None]
            kpos = torch.arange(length)[None, :]
            visible = kpos <= qpos
            if sliding_window:
                visible &= kpos > qpos - sliding_window
            s = s.masked_fill(~visible, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
        return out


def check(batch: Batch, dtype, sliding_window=0, softcap=0.0, num_decodes=0):
    scale = batch.query.shape[-1] ** -0.5
    out = batch.run(scale, sliding_window, softcap, num_decodes)
    ref = batch.reference(scale, sliding_window, softcap)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


# (cached context, new tokens): decodes, prefill chunks on top of a cached prefix, whole prompts.
MIXED = [(37, 1), (0, 23), (64, 1), (15, 17), (0, 1), (100, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(isa, dtype, heads, block_size):
    gen = torch.Generator().manual_seed(hash((isa, str(dtype), heads, block_size)) % 2**31)
    check(Batch(MIXED, *heads, 64, block_size, dtype, gen), dtype)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
def test_every_head_size(isa, head_size):
    gen = torch.Generator().manual_seed(head_size)
    for dtype in (torch.float32, torch.bfloat16):
        check(Batch([(20, 1), (3, 12)], 4, 2, head_size, 16, dtype, gen), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edges(isa, dtype):
    gen = torch.Generator().manual_seed(7)
    # sequence length 1; contexts ending exactly on a block boundary (before and after the step)
    check(Batch([(0, 1), (15, 1), (16, 16), (31, 1), (32, 32)], 4, 2, 64, 16, dtype, gen), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_shorter_than_context(isa, dtype):
    gen = torch.Generator().manual_seed(11)
    batch = Batch([(90, 1), (40, 30), (0, 50), (7, 1)], 8, 2, 64, 16, dtype, gen)
    check(batch, dtype, sliding_window=24)
    check(batch, dtype, sliding_window=1)


def test_softcap(isa):
    gen = torch.Generator().manual_seed(13)
    batch = Batch(MIXED, 4, 2, 64, 16, torch.float32, gen)
    batch.query *= 8  # large scores, so that the cap matters
    check(batch, torch.float32, softcap=5.0)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_long_single_decode_is_split_and_merged(isa, num_kv_heads):
    # Too few tiles for the threads: the keys are split over jobs and the partial states merged.
    gen = torch.Generator().manual_seed(17)
    for dtype in DTYPES:
        batch = Batch([(3000, 1)], 4 * num_kv_heads, num_kv_heads, 128, 16, dtype, gen)
        check(batch, dtype)
        check(batch, dtype, sliding_window=700)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_chunk_is_split_and_merged(isa, dtype):
    # A prompt chunk on a long cached prefix: its key ranges are split over jobs at block (not
    # 64-key chunk) boundaries, so the amx level's tiles see chunks that start and end mid-way;
    # a context that ends inside a block and a sliding window move the masked edges.
    gen = torch.Generator().manual_seed(19)
    for context, new in ((1000, 20), (1013, 37)):
        batch = Batch([(context, new)], 8, 2, 64, 16, dtype, gen)
        check(batch, dtype)
        check(batch, dtype, sliding_window=300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_counted_decodes_give_the_same_attention(isa, dtype):
    # A chunked prefill's step: decodes of long contexts, then prompt chunks. Counted, the decodes
    # run in the decode kernels on CUDA (split over the keys) and the chunks in the prefill kernel
    # (test_cuda_attention.py runs this there); the CPU checks the count and computes the same.
    gen = torch.Generator().manual_seed(19)
    batch = Batch([(2500, 1), (600, 1), (3, 1), (40, 70), (0, 9)], 8, 2, 64, 16, dtype, gen)
    for num_decodes in (0, 1, 3):
        check(batch, dtype, num_decodes=num_decodes)
        check(batch, dtype, sliding_window=300, num_decodes=num_decodes)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_a_16_bit_cache_serves_float32_queries(isa, cache_dtype, head_size):
    """kv_cache_dtype: float32 queries against K and V stored in 16 bits give float32's attention of
    the stored K and V (decodes, prefill chunks, a sliding window, a long decode split over jobs)."""
    gen = torch.Generator().manual_seed(head_size)
    batch = Batch(MIXED + [(700, 1)], 8, 2, head_size, 16, torch.float32, gen, cache_dtype)
    assert batch.key_cache.dtype == cache_dtype
    check(batch, torch.float32, num_decodes=1)
    check(batch, torch.float32, sliding_window=20)


def test_a_16_bit_cache_serves_bfloat16_queries(isa):
    gen = torch.Generator().manual_seed(3)
    check(Batch(MIXED, 8, 2, 64, 16, torch.bfloat16, gen, torch.float16), torch.bfloat16)
    check(Batch(MIXED, 8, 2, 64, 16, torch.bfloat16, gen, torch.float32), torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_reshape_and_cache_rounds_into_a_16_bit_cache(isa, cache_dtype):
    """Each value rounded to nearest-even as torch rounds it, overflow to inf (float16) included."""
    key = torch.randn(5, 2, 64) * torch.logspace(-8, 5, 5)[:, None, None]
    value = -key
    key[4, 1, :3] = torch.tensor([float("inf"), float("nan"), 1e6])
    key_cache = torch.zeros(2, 2, 16, 64, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    _C.ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([3, 17, 0, 31, 9], dtype=torch.int32))
    for t, slot in enumerate([3, 17, 0, 31, 9]):
        for cache, src in ((key_cache, key), (value_cache, value)):
            torch.testing.assert_close(cache[slot // 16, :, slot % 16], src[t].to(cache_dtype), rtol=0, atol=0,
                                       equal_nan=True)


def test_result_does_not_depend_on_thread_count():
    gen = torch.Generator().manual_seed(19)
    batch = Batch([(2000, 1), (50, 40)], 8, 2, 64, 16, torch.float32, gen)
    threads = _C.get_num_threads()
    try:
        _C.set_num_threads(1)
        one = batch.run(0.125)
        _C.set_num_threads(3)
        three = batch.run(0.125)
    finally:
        _C.set_num_threads(threads)
    torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots_and_skips_padding(isa, dtype):
    gen = torch.Generator().manual_seed(23)
    key_cache = torch.zeros(5, 2, 16, 64, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    qkv = torch.randn(6, 3 * 2 * 64, generator=gen).to(dtype)
    key = qkv[:, 128:256].view(6, 2, 64)  # strided views of a fused QKV output
    value = qkv[:, 256:].view(6, 2, 64)
    for slots in ([17, 18, -1, 79, 0, 40], torch.tensor([3, -1, -1, 64, 65, 33])):
        slot_mapping = torch.as_tensor(slots, dtype=torch.int32 if isinstance(slots, list) else torch.int64)
        _C.ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            assert torch.equal(key_cache[slot // 16, :, slot % 16], key[t])
            assert torch.equal(value_cache[slot // 16, :, slot % 16], value[t])
    untouched = torch.ones(5, 16, dtype=torch.bool)
    for slot in [17, 18, 79, 0, 40, 3, 64, 65, 33]:
        untouched[slot // 16, slot % 16] = False
    assert (key_cache.permute(0, 2, 1, 3)[untouched] == 0).all()


def test_bad_arguments_raise_clear_errors():
    gen = torch.Generator().manual_seed(29)
    b = Batch([(10, 2)], 4, 2, 64, 16, torch.float32, gen)
    out = torch.empty_like(b.query)
    args = [out, b.query, b.key_cache, b.value_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.125]
    _C.ops.paged_attention(*args)

    def call(**changes):
        names = ["out", "query", "key_cache", "value_cache", "query_start_loc", "seq_lens", "block_tables", "scale"]
        kwargs = dict(zip(names, args))
        kwargs.update(changes)
        _C.ops.paged_attention(**kwargs)

    with pytest.raises(TypeError, match="query"):
        call(query=b.query.double())
    with pytest.raises(TypeError, match="key_cache"):
        call(key_cache=b.key_cache.bfloat16())  # the value cache is float32
    with pytest.raises(TypeError, match="key_cache"):
        call(key_cache=b.key_cache.double(), value_cache=b.value_cache.double())
    with pytest.raises(TypeError, match="value_cache"):
        _C.ops.reshape_and_cache(b.keys[:2], b.values[:2], b.key_cache, b.value_cache.half(),
                                 torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="head_size 48"):
        q = torch.randn(2, 4, 48)
        call(query=q, out=torch.empty_like(q), key_cache=torch.zeros(3, 2, 16, 48), value_cache=torch.zeros(3, 2, 16, 48))
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        q = torch.randn(2, 3, 64)
        call(query=q, out=torch.empty_like(q))
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=torch.tensor([1], dtype=torch.int32))  # fewer tokens than its 2 queries
    with pytest.raises(ValueError, match="block_tables"):
        bad = b.block_tables.clone()
        bad[0, 0] = 1000
        call(block_tables=bad)
    with pytest.raises(ValueError, match="query_start_loc"):
        call(query_start_loc=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="num_decodes is 1, but sequence 0 has 2 query tokens"):
        call(num_decodes=1)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=r"num_decodes must be in \[0, 1\]"):
            call(num_decodes=bad)
    with pytest.raises(ValueError, match="slot_mapping"):
        _C.ops.reshape_and_cache(b.keys[:2], b.values[:2], b.key_cache, b.value_cache,
                                 torch.tensor([0, 10_000], dtype=torch.int32))
    with pytest.raises(TypeError, match="slot_mapping"):
        _C.ops.reshape_and_cache(b.keys[:2], b.values[:2], b.key_cache, b.value_cache, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="value"):
        _C.ops.reshape_and_cache(b.keys[:2], b.values[:3], b.key_cache, b.value_cache,
                                 torch.tensor([0, 1], dtype=torch.int32))


def test_kv_cache_dtype_names_and_devices():
    from octavo.kv_cache import kv_cache_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert kv_cache_dtype("half", torch.float32, cpu) == torch.float16
    assert kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="on CUDA the KV cache holds the model's dtype or fp8"):
        kv_cache_dtype("float16", torch.bfloat16, cuda)
    assert kv_cache_dtype("fp8", torch.float32, cpu) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16, cpu) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="of the fp8 formats, E4M3 is supported"):
        kv_cache_dtype("fp8_e5m2", torch.bfloat16, cpu)


@pytest.mark.parametrize("num_blocks", [3, 400])  # below and above one huge page
def test_empty_kv_cache_serves_attention(num_blocks):
    key_cache = empty_kv_cache((num_blocks, 2, 16, 64), torch.bfloat16)
    value_cache = empty_kv_cache((num_blocks, 2, 16, 64), torch.bfloat16)
    assert key_cache.shape == (num_blocks, 2, 16, 64) and key_cache.dtype == torch.bfloat16
    assert key_cache.is_contiguous() and key_cache.data_ptr() != value_cache.data_ptr()
    key = torch.randn(20, 2, 64).bfloat16()
    slots = torch.arange(20, dtype=torch.int32) + 16  # blocks 1 and 2
    _C.ops.reshape_and_cache(key, key, key_cache, value_cache, slots)
    assert torch.equal(key_cache[1, :, 3], key[3])
    assert torch.equal(value_cache[2, :, 1], key[17])


@pytest.mark.parametrize("heads,tokens_per_tile", [((4, 4), 128), ((8, 2), 32), ((32, 8), 32), ((32, 2), 8)])
def test_plan_lays_out_tiles_of_query_rows(heads, tokens_per_tile):
    """plan[b]: the first tile of sequence b, tiles of 128 (token, query head) rows of one KV head."""
    query_tokens = [1, 0, 128, 129, 3, 300]
    query_start_loc = torch.tensor([0] + query_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    plan = torch.full((len(query_tokens) + 1,), -7, dtype=torch.int32)
    _C.ops.plan_paged_attention(plan, query_start_loc, *heads)
    tiles = [math.ceil(n / tokens_per_tile) for n in query_tokens]
    assert plan.tolist() == [sum(tiles[:b]) for b in range(len(tiles) + 1)]
    # The CPU kernel takes a plan and needs none: the result is the same.
    gen = torch.Generator().manual_seed(4)
    batch = Batch(MIXED, 8, 2, 64, 16, torch.float32, gen)
    out, planned = batch.run(0.125), torch.empty_like(batch.query)
    plan = torch.empty(len(MIXED) + 1, dtype=torch.int32)
    _C.ops.plan_paged_attention(plan, batch.query_start_loc, 8, 2)
    _C.ops.paged_attention(planned, batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                           batch.seq_lens, batch.block_tables, 0.125, plan=plan)
    assert torch.equal(planned, out)


def test_plan_refuses_bad_arguments():
    qsl = torch.tensor([0, 3, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        _C.ops.plan_paged_attention(torch.empty(3, dtype=torch.int32), qsl, 4, 2)
    with pytest.raises(ValueError, match="plan"):
        _C.ops.plan_paged_attention(torch.empty(2, dtype=torch.int32), qsl, 4, 2)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        _C.ops.plan_paged_attention(torch.empty(3, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), 6, 4)
    with pytest.raises(ValueError, match="by at most 16"):  # the CUDA kernels' largest GQA group
        _C.ops.plan_paged_attention(torch.empty(3, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), 64, 2)


FP8_SCALES = [(1.0, 1.0), (0.02, 0.3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("kv_scales", FP8_SCALES)
def test_an_fp8_cache_serves_queries(isa, dtype, head_size, kv_scales):
    """kv_cache_dtype="fp8": queries of each dtype against K / k_scale and V / v_scale stored in E4M3
    give the attention of the stored K and V times their scales (decodes, prefill chunks, a sliding
    window, a long decode split over jobs)."""
    gen = torch.Generator().manual_seed(head_size + int(kv_scales[0] * 100))
    batch = Batch(MIXED + [(700, 1)], 8, 2, head_size, 16, dtype, gen, torch.float8_e4m3fn, kv_scales)
    check(batch, dtype, num_decodes=1)
    check(batch, dtype, sliding_window=20)


@pytest.mark.parametrize("kv_scales", FP8_SCALES)
def test_reshape_and_cache_rounds_into_an_fp8_cache(isa, kv_scales):
    """Each value / scale rounded to nearest-even E4M3 as torch rounds it, from subnormals (2^-9) to
    448; past 448 (inf included) saturated to +-448 as vLLM's fp8 cache writes; NaN stays NaN."""
    k_scale, v_scale = kv_scales
    key = torch.randn(6, 2, 64, dtype=torch.float64) * torch.logspace(-4, 3, 6, dtype=torch.float64)[:, None, None]
    key[5, 0] = torch.tensor([float(c) for c in range(64)]) * 2.0**-10  # midpoints of subnormal steps (ties)
    key[5, 1, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e6, -449.0, 464.0])
    key = (key * k_scale).float()
    value = -key * (v_scale / k_scale)
    key_cache = torch.zeros(2, 2, 16, 64, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros_like(key_cache)
    slots = [3, 17, 0, 31, 9, 20]
    _C.ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int32),
                             k_scale=k_scale, v_scale=v_scale)
    for t, slot in enumerate(slots):
        for cache, src, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
            stored = cache[slot // 16, :, slot % 16].view(torch.uint8)
            want = fp8(src[t], scale)
            want = torch.where(src[t].isnan(), torch.tensor(float("nan")).to(torch.float8_e4m3fn), want)
            assert torch.equal(stored.view(torch.float8_e4m3fn).float().nan_to_num(7.0),
                               want.float().nan_to_num(7.0)), (t, slot)
    assert key_cache[20 // 16, 1, 20 % 16, :6].float().tolist()[:2] == [448.0, -448.0]


@pytest.mark.parametrize("nan_codes", [True, False], ids=["with-nan", "finite"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_fp8_code_reads_as_its_value(isa, dtype, nan_codes):
    """A query that sees one key gets that key's value row times v_scale: here every one of the 256
    E4M3 codes (subnormals, +-448, NaN) read through the attention kernel's loads. A block holding a
    NaN code is read exactly; one without (the finite case: NaN codes replaced by zeros) through
    the cheaper loads, which must give the same values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 1, 1, 64)
    if not nan_codes:
        codes[(codes & 0x7F) == 0x7F] = 0
    value_cache = torch.zeros(5, 1, 16, 64, dtype=torch.uint8)
    value_cache[1:, :, :1] = codes
    value_cache = value_cache.view(torch.float8_e4m3fn)
    key_cache = torch.zeros_like(value_cache)
    query = torch.randn(4, 2, 64).to(dtype)
    out = torch.empty_like(query)
    ones = torch.ones(4, dtype=torch.int32)
    _C.ops.paged_attention(out, query, key_cache, value_cache, torch.arange(5, dtype=torch.int32), ones,
                           torch.arange(1, 5, dtype=torch.int32)[:, None], 0.125, num_decodes=4, v_scale=0.5)
    want = (codes.view(torch.float8_e4m3fn).float() * 0.5).view(4, 1, 64).expand(4, 2, 64).to(dtype)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


def test_fp8_scales_are_checked():
    b = Batch([(10, 2)], 4, 2, 64, 16, torch.float32, torch.Generator().manual_seed(5), torch.float8_e4m3fn)
    out = torch.empty_like(b.query)
    args = [out, b.query, b.key_cache, b.value_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.125]
    slots = torch.tensor([0, 1], dtype=torch.int32)
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e-50, 1e39):
        with pytest.raises(ValueError, match="k_scale must be positive and finite"):
            _C.ops.paged_attention(*args, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be positive and finite"):
            _C.ops.reshape_and_cache(b.keys[:2], b.values[:2], b.key_cache, b.value_cache, slots, v_scale=bad)
    plain = Batch([(10, 2)], 4, 2, 64, 16, torch.float32, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="k_scale and v_scale scale an fp8 cache; a float32 cache takes 1.0"):
        _C.ops.reshape_and_cache(plain.keys[:2], plain.values[:2], plain.key_cache, plain.value_cache, slots,
                                 k_scale=2.0)
    with pytest.raises(TypeError, match="value_cache"):  # fp8 beside a float cache
        _C.ops.paged_attention(out, b.query, b.key_cache, plain.value_cache, *args[4:])
