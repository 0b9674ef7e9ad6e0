// paged_attention: argument checks, then the CPU or CUDA launcher. For CPU tensors the batch
// metadata is validated on the host, so a bad block table is an error rather than a stray read;
// the CUDA kernel masks what it cannot use instead (see cuda_kernels.h).
#include <algorithm>

#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {

namespace {

bool supported_head_size(int64_t d) { return d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

// query_start_loc, seq_lens and block_tables must describe a valid batch over the cache.
void check_batch(const PagedAttentionParams& p) {
  OCTAVO_CHECK(p.query_start_loc[0] == 0, "query_start_loc[0] must be 0, got " << p.query_start_loc[0]);
  OCTAVO_CHECK(p.query_start_loc[p.num_seqs] == p.num_tokens,
               "query_start_loc[-1] must equal the number of query tokens (" << p.num_tokens << "), got "
                                                                              << p.query_start_loc[p.num_seqs]);
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t n_q = p.query_start_loc[b + 1] - p.query_start_loc[b];
    const int64_t len = p.seq_lens[b];
    OCTAVO_CHECK(n_q >= 0, "query_start_loc must be non-decreasing (at sequence " << b << ")");
    OCTAVO_CHECK(b >= p.num_decodes || n_q == 1, "num_decodes is " << p.num_decodes << ", but sequence " << b
                                                                   << " has " << n_q << " query tokens, not 1");
    OCTAVO_CHECK(len >= n_q && len <= capacity, "seq_lens[" << b << "] = " << len << " must be at least its "
                                                            << n_q << " query tokens and at most the block table's "
                                                            << capacity << " slots");
    const int32_t* table = p.block_tables + b * p.block_table_stride;
    for (int64_t i = 0; i < (len + p.block_size - 1) / p.block_size; ++i) {
      OCTAVO_CHECK(table[i] >= 0 && table[i] < p.num_blocks, "block_tables[" << b << ", " << i << "] = " << table[i]
                                                                             << " is not a block of the cache (0.."
                                                                             << p.num_blocks - 1 << ")");
    }
  }
}

}  // namespace

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& query_start_loc, const TensorView& seq_lens,
                     const TensorView& block_tables, double scale, int64_t sliding_window, double softcap,
                     const TensorView* plan, int64_t num_decodes, double k_scale, double v_scale) {
  ops::check_float(query, "query");
  check_ndim(query, "query", 3);
  const ops::Rows q = ops::as_rows(query, "query");
  ops::check_same_device(out, "out", query, "query");
  ops::check_same_dtype(out, "out", query, "query");
  check_ndim(out, "out", 3);
  const ops::Rows o = ops::as_rows(out, "out");
  for (int d = 0; d < 3; ++d) check_size(out, "out", d, query.shape[d]);
  ops::check_kv_cache(key_cache, "key_cache", query, "query");
  ops::check_kv_cache(value_cache, "value_cache", query, "query");
  ops::check_same_dtype(value_cache, "value_cache", key_cache, "key_cache");
  ops::check_kv_scales(key_cache, k_scale, v_scale);
  for (int d = 0; d < 4; ++d) check_size(value_cache, "value_cache", d, key_cache.shape[d]);
  check_size(key_cache, "key_cache", 3, query.shape[2]);
  const int64_t num_heads = query.shape[1], num_kv_heads = key_cache.shape[1], head_size = query.shape[2];
  OCTAVO_CHECK(supported_head_size(head_size),
               "head_size " << head_size << " is not supported (supported: 32, 64, 80, 96, 128, 256)");
  OCTAVO_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
               "the number of query heads (" << num_heads << ") must be a multiple of the number of KV heads ("
                                             << num_kv_heads << ")");
  check_ndim(seq_lens, "seq_lens", 1);
  const int64_t num_seqs = seq_lens.shape[0];
  OCTAVO_CHECK(num_seqs > 0 || query.shape[0] == 0, "query tokens need at least one sequence (seq_lens is empty)");
  ops::check_vector(seq_lens, "seq_lens", DType::kInt32, num_seqs, query, "query");
  ops::check_vector(query_start_loc, "query_start_loc", DType::kInt32, num_seqs + 1, query, "query");
  ops::check_same_device(block_tables, "block_tables", query, "query");
  check_dtype(block_tables, "block_tables", DType::kInt32);
  check_ndim(block_tables, "block_tables", 2);
  check_size(block_tables, "block_tables", 0, num_seqs);
  const ops::Rows bt = ops::as_rows(block_tables, "block_tables");
  OCTAVO_CHECK(scale > 0, "scale must be positive, got " << scale);
  OCTAVO_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0 = off), got " << sliding_window);
  OCTAVO_CHECK(softcap >= 0, "softcap must be >= 0 (0 = off), got " << softcap);
  if (plan != nullptr) ops::check_vector(*plan, "plan", DType::kInt32, num_seqs + 1, query, "query");
  OCTAVO_CHECK(num_decodes >= 0 && num_decodes <= num_seqs && num_decodes <= query.shape[0],
               "num_decodes must be in [0, " << std::min(num_seqs, query.shape[0]) << "] (sequences with one query "
                                             << "token each, at the batch's start), got " << num_decodes);

  PagedAttentionParams p{};
  p.out = out.data;
  p.query = query.data;
  p.key_cache = key_cache.data;
  p.value_cache = value_cache.data;
  p.query_start_loc = query_start_loc.data_as<int32_t>();
  p.seq_lens = seq_lens.data_as<int32_t>();
  p.block_tables = block_tables.data_as<int32_t>();
  p.num_seqs = num_seqs;
  p.num_tokens = query.shape[0];
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_size = head_size;
  p.block_size = key_cache.shape[2];
  p.num_blocks = key_cache.shape[0];
  p.block_table_stride = bt.stride;
  p.max_blocks_per_seq = bt.cols;
  p.out_stride = o.stride;
  p.query_stride = q.stride;
  p.sliding_window = sliding_window;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.dtype = query.dtype;
  p.cache_dtype = key_cache.dtype;
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.tile_offsets = plan != nullptr ? plan->data_as<int32_t>() : nullptr;
  p.num_decodes = num_decodes;
  if (ops::runs_on_cuda(query, "query")) {
    cuda::paged_attention(p);
  } else {
    check_batch(p);
    cpu_dispatch(paged_attention, p);
  }
}

void plan_paged_attention(const TensorView& plan, const TensorView& query_start_loc, int64_t num_heads,
                          int64_t num_kv_heads) {
  ops::check_vector(query_start_loc, "query_start_loc", DType::kInt32, -1);  // on the host, as plan
  const int64_t num_seqs = query_start_loc.shape[0] - 1;
  OCTAVO_CHECK(num_seqs >= 0, "query_start_loc must hold at least one offset");
  ops::check_vector(plan, "plan", DType::kInt32, num_seqs + 1);
  OCTAVO_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= cuda::kMaxGroup,
               "num_heads (" << num_heads << ") must be a multiple of num_kv_heads (" << num_kv_heads
                             << ") by at most " << cuda::kMaxGroup << ", as the CUDA kernels take");
  const auto group = static_cast<int32_t>(num_heads / num_kv_heads);
  const auto* starts = query_start_loc.data_as<int32_t>();
  auto* offsets = plan.data_as<int32_t>();
  int32_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    offsets[b] = total;
    OCTAVO_CHECK(starts[b + 1] >= starts[b], "query_start_loc must be non-decreasing (at sequence " << b << ")");
    total += cuda::prefill_tiles(starts[b + 1] - starts[b], group);
  }
  offsets[num_seqs] = total;
}

}  // namespace octavo
