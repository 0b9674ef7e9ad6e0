// reshape_and_cache: copies each new token's key and value heads into its paged-cache slot (converted
// when the cache holds another float dtype than the step: an engine's kv_cache_dtype; an fp8
// cache holds each value divided by its scale, k_scale or v_scale).
// Cache layout [num_blocks, num_kv_heads, block_size, head_size]: one KV head of one block is a
// contiguous block_size x head_size tile, which attention streams through.
#include <cstring>
#include <type_traits>

#include "isa_kernels.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

// A head's n values from the step's dtype into the cache's (a kv_cache_dtype other than the model's).
template <typename Src, typename Dst>
void convert_head(const Src* src, Dst* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) VecF::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = from_float<Dst>(to_float(src[i]));
}

// The same into an fp8 cache: value / scale, rounded to E4M3 (saturating at +-448).
template <typename Src>
void convert_head(const Src* src, fp8e4m3* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<fp8e4m3>(to_float(src[i]) / scale);
}

template <typename Index, typename Src, typename Dst>
void write_tokens(const CacheWriteParams& p, int64_t begin, int64_t end) {
  const Index* slots = static_cast<const Index*>(p.slot_mapping);
  const auto* key = static_cast<const Src*>(p.key);
  const auto* value = static_cast<const Src*>(p.value);
  auto* key_cache = static_cast<Dst*>(p.key_cache);
  auto* value_cache = static_cast<Dst*>(p.value_cache);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / p.block_size, offset = slot % p.block_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const int64_t dst = ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size;
      const Src* k = key + t * p.key_stride + h * p.head_size;
      const Src* v = value + t * p.value_stride + h * p.head_size;
      if constexpr (std::is_same<Src, Dst>::value) {
        std::memcpy(key_cache + dst, k, p.head_size * sizeof(Src));
        std::memcpy(value_cache + dst, v, p.head_size * sizeof(Src));
      } else if constexpr (std::is_same<Dst, fp8e4m3>::value) {
        convert_head(k, key_cache + dst, p.head_size, p.k_scale);
        convert_head(v, value_cache + dst, p.head_size, p.v_scale);
      } else {
        convert_head(k, key_cache + dst, p.head_size);
        convert_head(v, value_cache + dst, p.head_size);
      }
    }
  }
}

// fn(T{}) with T the C++ type of float dtype t (a step's, or also fp8 with `fp8`: a cache's).
template <bool fp8 = false, typename Fn>
void with_float_type(DType t, const Fn& fn) {
  switch (t) {
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(bf16{});
    case DType::kFloat8E4M3:
      if constexpr (fp8) return fn(fp8e4m3{});
      [[fallthrough]];
    default: return fn(f16{});
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteParams& p) {
  // A decode step writes one token per sequence: a few KiB, not worth waking the pool for.
  const int64_t grain = 64;
  parallel_for(p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    with_float_type(p.dtype, [&](auto src) {
      with_float_type</*fp8=*/true>(p.cache_dtype, [&](auto dst) {
        using Src = decltype(src);
        using Dst = decltype(dst);
        if (p.slot_dtype == DType::kInt32) write_tokens<int32_t, Src, Dst>(p, begin, end);
        else write_tokens<int64_t, Src, Dst>(p, begin, end);
      });
    });
  });
}

}  // namespace octavo::cpu::OCTAVO_ISA
