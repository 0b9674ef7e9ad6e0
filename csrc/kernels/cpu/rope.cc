// rotary_embedding: rotates the first rot_dim dims of every query and key head in place by the
// token's position. Tokens are spread over the thread pool; each token reads its cos/sin row once
// and applies it to all of its heads.
#include "isa_kernels.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

// Below this many elements a call stays on the calling thread; above, chunks of at least
// kMinChunkElems (see grain_for).
constexpr int64_t kSerialElems = 65536;
constexpr int64_t kMinChunkElems = 16384;

// GPT-NeoX / Llama: x[i], x[i + half] form a pair, rotated by angle i.
// x: [head_size] of one head; cos, sin: [half]
template <typename T>
void rotate_neox(T* x, const float* cos, const float* sin, int64_t half) {
  T* y = x + half;
  int64_t i = 0;
  for (; i + kW <= half; i += kW) {
    const VecF c = VecF::load(cos + i), s = VecF::load(sin + i);
    const VecF a = VecF::load(x + i), b = VecF::load(y + i);
    (a * c - b * s).store(x + i);
    fma(b, c, a * s).store(y + i);
  }
  if (i < half) {  // rot_dim / 2 not a multiple of the vector width
    const int m = static_cast<int>(half - i);
    const VecF c = load_partial(cos + i, m), s = load_partial(sin + i, m);
    const VecF a = load_partial(x + i, m), b = load_partial(y + i, m);
    store_partial(a * c - b * s, x + i, m);
    store_partial(fma(b, c, a * s), y + i, m);
  }
}

#if defined(__AVX512F__)
inline VecF swap_pairs(VecF v) { return {_mm512_permute_ps(v.v, 0xb1)}; }  // lanes 2i <-> 2i+1
#elif defined(__AVX2__)
inline VecF swap_pairs(VecF v) { return {_mm256_permute_ps(v.v, 0xb1)}; }
#endif

// GPT-J: x[2i], x[2i + 1] form a pair, rotated by angle i. cos2 / sin2 hold each angle twice,
// sin2 negated on even lanes, so x' = x * cos2 + swap_pairs(x) * sin2 on whole vectors.
// x: [head_size] of one head; cos2, sin2: [rot_dim]
template <typename T>
void rotate_gptj(T* x, const float* cos2, const float* sin2, int64_t rot_dim) {
#if defined(__AVX2__)
  int64_t i = 0;
  for (; i + kW <= rot_dim; i += kW) {
    const VecF v = VecF::load(x + i);
    fma(v, VecF::load(cos2 + i), swap_pairs(v) * VecF::load(sin2 + i)).store(x + i);
  }
  if (i < rot_dim) {  // an even count, so pairs stay whole
    const int m = static_cast<int>(rot_dim - i);
    const VecF v = load_partial(x + i, m);
    store_partial(fma(v, load_partial(cos2 + i, m), swap_pairs(v) * load_partial(sin2 + i, m)), x + i, m);
  }
#else
  for (int64_t i = 0; i < rot_dim; i += 2) {
    const float a = to_float(x[i]), b = to_float(x[i + 1]);
    x[i] = from_float<T>(a * cos2[i] + b * sin2[i]);
    x[i + 1] = from_float<T>(b * cos2[i + 1] + a * sin2[i + 1]);
  }
#endif
}

// Interleaves one cache row for rotate_gptj. row: [rot_dim] (cos half, sin half).
void interleave_cos_sin(const float* row, int64_t half, float* cos2, float* sin2) {
  for (int64_t i = 0; i < half; ++i) {
    cos2[2 * i] = cos2[2 * i + 1] = row[i];
    sin2[2 * i] = -row[half + i];
    sin2[2 * i + 1] = row[half + i];
  }
}

// Rotates all heads of one tensor (query or key) for one token.
// x: [heads, head_size] of the token
template <typename T>
void rotate_token(const RotaryParams& p, T* x, int64_t heads, const float* cos, const float* sin) {
  const int64_t half = p.rot_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* head = x + h * p.head_size;
    if (p.is_neox) rotate_neox(head, cos, sin, half);
    else rotate_gptj(head, cos, sin, p.rot_dim);
  }
}

template <typename T, typename Index>
void rotate_tokens(const RotaryParams& p, int64_t begin, int64_t end) {
  const Index* positions = static_cast<const Index*>(p.positions);
  const int64_t half = p.rot_dim / 2;
  float* scratch = p.is_neox ? nullptr : static_cast<float*>(thread_scratch(0, 2 * p.rot_dim * sizeof(float)));
  for (int64_t t = begin; t < end; ++t) {
    const float* row = p.cos_sin_cache + static_cast<int64_t>(positions[t]) * p.rot_dim;
    const float* cos = row;
    const float* sin = row + half;
    if (!p.is_neox) {
      interleave_cos_sin(row, half, scratch, scratch + p.rot_dim);
      cos = scratch;
      sin = scratch + p.rot_dim;
    }
    rotate_token(p, static_cast<T*>(p.query) + t * p.query_stride, p.num_heads, cos, sin);
    if (p.key) rotate_token(p, static_cast<T*>(p.key) + t * p.key_stride, p.num_kv_heads, cos, sin);
  }
}

template <typename T, typename Index>
void run_rotary(const RotaryParams& p) {
  const int64_t per_token = (p.num_heads + (p.key ? p.num_kv_heads : 0)) * p.rot_dim;
  parallel_for(p.num_tokens, grain_for(p.num_tokens, per_token, kSerialElems, kMinChunkElems),
               [&](int64_t begin, int64_t end) { rotate_tokens<T, Index>(p, begin, end); });
}

template <typename T>
void run_rotary_positions(const RotaryParams& p) {
  if (p.positions_dtype == DType::kInt32) run_rotary<T, int32_t>(p);
  else run_rotary<T, int64_t>(p);
}

}  // namespace

void rotary_embedding(const RotaryParams& p) {
  if (p.num_tokens == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return run_rotary_positions<float>(p);
    case DType::kBFloat16: return run_rotary_positions<bf16>(p);
    case DType::kFloat16: return run_rotary_positions<f16>(p);
    default: OCTAVO_CHECK(false, "rotary_embedding: unsupported dtype " << dtype_name(p.dtype));
  }
}

}  // namespace octavo::cpu::OCTAVO_ISA
