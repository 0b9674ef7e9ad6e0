// apply_token_bitmask: each 32-bit word of a row's mask covers 32 logits; a word of all ones
// (allowed) leaves them unread, a word of zeros (the common case under a grammar: most of the
// vocabulary is banned) stores -inf without reading, and a mixed word blends lane by lane.
#include <cmath>
#include <cstdint>

#include "isa_kernels.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

// Rows of a 150k vocabulary are 600 KB: a few rows are worth a thread each.
constexpr int64_t kSerialElems = 1 << 16;
constexpr int64_t kMinChunkElems = 1 << 16;

void mask_row(float* row, const int32_t* mask, int64_t vocab) {
  const VecF banned = VecF::set1(-INFINITY);
  const int64_t full_words = vocab / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(mask[w]);
    if (bits == 0xffffffffu) continue;
    float* x = row + w * 32;
    for (int j = 0; j < 32; j += kW) {
      const VecF v = bits == 0 ? banned : select_by_bits(bits >> j, VecF::load(x + j), -INFINITY);
      v.store(x + j);
    }
  }
  const uint32_t tail = full_words < (vocab + 31) / 32 ? static_cast<uint32_t>(mask[full_words]) : ~0u;
  for (int64_t t = full_words * 32; t < vocab; ++t) {
    if (!((tail >> (t % 32)) & 1u)) row[t] = -INFINITY;
  }
}

}  // namespace

void apply_token_bitmask(const TokenBitmaskParams& p) {
  const int64_t grain = grain_for(p.num_rows, p.vocab_size, kSerialElems, kMinChunkElems);
  parallel_for(p.num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = p.indices ? p.indices[i] : i;
      mask_row(p.logits + r * p.logits_stride, p.bitmask + i * p.words, p.vocab_size);
    }
  });
}

}  // namespace octavo::cpu::OCTAVO_ISA
