// The CPU kernels' thread pool. One process-wide pool; the calling thread takes part in every
// parallel_for, so a pool of N threads runs N-1 workers. Workers spin briefly after a job
// (a decode step issues hundreds of short kernels back to back) and then sleep.
#pragma once

#include <cstdint>

namespace octavo {

// Threads used by CPU kernels. Default: the CPUs this process may run on, or OCTAVO_NUM_THREADS.
int get_num_threads();
// n >= 1. Takes effect for the next kernel; must not be called from inside a kernel.
void set_num_threads(int n);

// Calls fn(ctx, begin, end) over [0, n) in chunks of at most `grain` items, spread over the
// pool; returns when every chunk is done. The first exception thrown by a chunk is rethrown
// here. Called from inside a chunk (or while another thread owns the pool) it runs serially.
using ParallelFn = void (*)(void* ctx, int64_t begin, int64_t end);
void parallel_for(int64_t n, int64_t grain, ParallelFn fn, void* ctx);

// Per-thread scratch memory for kernels, 64-byte aligned, grown on demand and kept for reuse
// (so steady-state kernels allocate nothing). `slot` lets one kernel hold several buffers.
// Valid until the same thread asks for the same slot again.
void* thread_scratch(int slot, size_t bytes);
constexpr int kNumScratchSlots = 4;

}  // namespace octavo
