// reshape_and_cache: copies each new token's key and value heads into its paged-cache slot.
// Cache layout [num_blocks, num_kv_heads, block_size, head_size]: one KV head of one block is a
// contiguous block_size x head_size tile, which attention streams through.
#include <cstring>

#include "isa_kernels.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

template <typename Index>
void write_tokens(const CacheWriteParams& p, int64_t begin, int64_t end) {
  const Index* slots = static_cast<const Index*>(p.slot_mapping);
  const size_t elem = dtype_size(p.dtype);
  const size_t head_bytes = static_cast<size_t>(p.head_size) * elem;
  const auto* key = static_cast<const char*>(p.key);
  const auto* value = static_cast<const char*>(p.value);
  auto* key_cache = static_cast<char*>(p.key_cache);
  auto* value_cache = static_cast<char*>(p.value_cache);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / p.block_size, offset = slot % p.block_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const int64_t dst = ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size;
      std::memcpy(key_cache + dst * elem, key + (t * p.key_stride + h * p.head_size) * elem, head_bytes);
      std::memcpy(value_cache + dst * elem, value + (t * p.value_stride + h * p.head_size) * elem, head_bytes);
    }
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteParams& p) {
  // A decode step writes one token per sequence: a few KiB, not worth waking the pool for.
  const int64_t grain = 64;
  parallel_for(p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    if (p.slot_dtype == DType::kInt32) write_tokens<int32_t>(p, begin, end);
    else write_tokens<int64_t>(p, begin, end);
  });
}

}  // namespace octavo::cpu::OCTAVO_ISA
