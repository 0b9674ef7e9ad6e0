// The simulator behind cuda_sim.h: a fiber per CUDA thread, a scheduler that releases barriers
// and warp collectives, the tensor-core fragments, and the runtime API on host memory.
#include "cuda_sim.h"

#include <pthread.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_SIM_ASAN 1
#endif
#ifdef CUDA_SIM_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_read_range(void* addr, unsigned long size);
extern "C" void __tsan_write_range(void* addr, unsigned long size);
#endif

namespace cuda_sim {
namespace {

// Fiber stacks are mapped lazily, so only the pages a kernel touches cost memory; unoptimized
// and sanitizer builds keep large frames.
constexpr size_t kStackBytes = size_t{1} << 20;
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr int kWarp = 32;

enum class State { kRunnable, kAtBarrier, kInCollective, kExited };

// ---- Contexts: a saved stack pointer (x86-64) or a ucontext ----------------------------------------
// glibc's swapcontext also saves the signal mask, a system call per switch; a kernel switches
// tens of thousands of times per block, so on x86-64 the switch is a few instructions of our own.
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};
}  // namespace
}  // namespace cuda_sim

// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores
// the stack pointer in *from, and resumes the stack `to` saved the same way (System V ABI).
extern "C" void cuda_sim_switch(void** from, void* to);
asm(R"(
  .text
  .globl cuda_sim_switch
  .type cuda_sim_switch, @function
cuda_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_sim_switch, .-cuda_sim_switch
)");

namespace cuda_sim {
namespace {

void switch_context(Context& from, Context& to) { cuda_sim_switch(&from.sp, to.sp); }

// A stack that cuda_sim_switch resumes into `entry`, as if called: the return address sits at a
// 16-byte boundary, below it the six registers and the control words (default values).
void make_context(Context& c, void* stack, size_t bytes, void (*entry)()) {
  auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t{15});
  top[-1] = 0;  // entry's own return address: it never returns
  top[-2] = reinterpret_cast<uint64_t>(entry);
  for (int i = 3; i <= 8; ++i) top[-i] = 0;        // rbp, rbx, r12-r15
  top[-9] = uint64_t{0x1f80} | uint64_t{0x037f} << 32;  // MXCSR, x87 control word
  c.sp = top - 9;
}
#else
struct Context {
  ucontext_t uc;
};
void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
void make_context(Context& c, void* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// ---- The race check (CUDA_SIM_TSAN) ---------------------------------------------------------------
// In the racecheck build, ThreadSanitizer sees every fiber as a thread of its own. Switches carry
// no ordering, so two fibers' accesses to one address are a race unless something CUDA promises
// orders them: a __syncthreads both pass (a release on arrival, an acquire on leaving), the
// launch (the host's writes before it, its reads after it; blocks run one after another, and
// each has its own shared memory on a GPU, so blocks are ordered too). Warp collectives order
// nothing, as a shuffle does not on a GPU. This file itself is built without instrumentation: its
// bookkeeping is not CUDA code, and what it does for a fiber is reported as that fiber's access
// explicitly: ldmatrix reading its rows, and a cp.async copy writing shared memory when it is
// issued, at each barrier while it is pending, and when it lands (a GPU may write it any time in
// between). Blocks are ordered one after another, so races between blocks are not seen.
namespace race {
#ifdef CUDA_SIM_TSAN
void* current() { return __tsan_get_current_fiber(); }
// What `fiber` has done happens before whoever acquires `sync` next, though it never runs again
// (a failed launch abandons its fibers where they stopped).
void release_for(void* fiber, void* sync) {
  void* self = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync);
  __tsan_release(sync);
  __tsan_switch_to_fiber(self, __tsan_switch_to_fiber_no_sync);
}
void* create(int thread) {
  void* fiber = __tsan_create_fiber(0);
  const std::string name = "CUDA thread " + std::to_string(thread);  // copied by the runtime
  __tsan_set_fiber_name(fiber, name.c_str());
  return fiber;
}
void switch_to(void* fiber) { __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync); }
void release(void* sync) { __tsan_release(sync); }
void acquire(void* sync) { __tsan_acquire(sync); }
void read(const void* p, size_t n) { __tsan_read_range(const_cast<void*>(p), n); }
void write(void* p, size_t n) { __tsan_write_range(p, n); }
#else
void* current() { return nullptr; }
void release_for(void*, void*) {}
void* create(int) { return nullptr; }
void switch_to(void*) {}
void release(void*) {}
void acquire(void*) {}
void read(const void*, size_t) {}
void write(void*, size_t) {}
#endif
}  // namespace race

struct Fiber {
  Context context;
  void* stack = nullptr;
  void* race_fiber = nullptr;  // ThreadSanitizer's, in the racecheck build
  unsigned barriers_passed = 0, warp_barriers_passed = 0;
  uint3 idx{0, 0, 0};
  int linear = 0;
  unsigned turn = 0;  // its place in the block's pass order
  State state = State::kRunnable;
  // While kInCollective: the collective and this lane's operand and result.
  const char* kind = nullptr;
  unsigned mask = 0;
  const void* in = nullptr;
  void* out = nullptr;
  int arg = 0;
  Combine combine = nullptr;
  int predicate = 0;  // at a barrier: its own; once released: the block's OR
  // cp.async copies not yet waited for, each with its group (open_group: not committed yet).
  struct PendingCopy {
    unsigned char* shared;
    unsigned char bytes[16];
    int group;
  };
  std::vector<PendingCopy> copies;
  int open_group = 0;
};

// A thrown Failure ends a kernel thread; the message is already recorded.
struct Failure {};

struct Launch {
  Entry entry = nullptr;
  void* call = nullptr;
  dim3 grid, block;
  uint3 block_idx{0, 0, 0};
  size_t shared_bytes = 0;
  unsigned char* shared = nullptr;
  unsigned threads = 0;  // per block
  std::vector<unsigned> order;  // the fibers in the order each pass runs them
  Fiber* current = nullptr;  // the running fiber; null while the scheduler runs
  Context scheduler;
  std::string error;  // the first failure; stops the launch
  // The race check's synchronization objects (their addresses): the block's start and end, and
  // its barriers, alternately (a fiber that is through one barrier and arrives at the next must
  // not publish to a fiber still leaving the first).
  char block_start = 0, block_end = 0, barrier[2] = {};
  std::vector<char> warp_barrier;  // the same for each warp's __syncwarp: two per warp
  void* race_scheduler = nullptr;
#ifdef CUDA_SIM_ASAN
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_bytes = 0;
#endif
};

std::mutex g_mutex;  // one launch (and one runtime call) at a time
Launch* g_launch = nullptr;
std::vector<Fiber> g_fibers;  // reused, with their stacks, by every launch
std::vector<DeviceProperties> g_devices(1);  // device 0: an H100
thread_local int t_device = 0;  // the host thread's current device, as in CUDA
std::map<std::pair<int, const void*>, size_t> g_shared_limits;  // per (device, kernel), as cudaFuncSetAttribute sets them
// Device memory stays allocated until cudaFree, like a GPU's: the table is never destroyed, so
// buffers the host keeps for good (workspaces) remain reachable for LeakSanitizer after exit.
std::set<void*>& allocations() {
  static auto* table = new std::set<void*>;
  return *table;
}
cudaError_t g_last_error = cudaSuccess;
std::string g_last_message;

Launch& running() {
  if (g_launch == nullptr || g_launch->current == nullptr) {
    std::fprintf(stderr, "cuda_sim: a device function was called outside a kernel\n");
    std::abort();
  }
  return *g_launch;
}

std::string where(const Launch& l, const Fiber& f) {
  std::ostringstream s;
  s << "block (" << l.block_idx.x << ',' << l.block_idx.y << ',' << l.block_idx.z << ") thread (" << f.idx.x << ','
    << f.idx.y << ',' << f.idx.z << ')';
  return s.str();
}

void record_failure(Launch& l, const std::string& why) {
  if (l.error.empty()) l.error = why;
}

// ---- Switching between the scheduler and the fibers -------------------------------------------
// A pass of the scheduler runs every runnable fiber once, in thread order: each fiber that blocks
// or exits hands over straight to the next runnable one, and the last back to the scheduler.
// Under ASan every switch tells the sanitizer which stack comes next.
void transfer(Launch& l, Context& from, bool from_exits, Fiber* to) {
  l.current = to;
#ifdef CUDA_SIM_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(from_exits ? nullptr : &fake_stack, to ? to->stack : l.scheduler_stack,
                                 to ? kStackBytes : l.scheduler_stack_bytes);
#else
  (void)from_exits;
#endif
  race::switch_to(to ? to->race_fiber : l.race_scheduler);
  switch_context(from, to ? to->context : l.scheduler);
#ifdef CUDA_SIM_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

// The first runnable fiber from place `turn` of the pass order on.
Fiber* next_runnable(Launch& l, unsigned turn) {
  for (unsigned i = turn; i < l.threads; ++i)
    if (g_fibers[l.order[i]].state == State::kRunnable) return &g_fibers[l.order[i]];
  return nullptr;
}

// On a fiber that has just blocked or exited: on with the pass, until a release resumes it.
void yield(Launch& l, Fiber& f) {
  Fiber* next = l.error.empty() ? next_runnable(l, f.turn + 1) : nullptr;
  transfer(l, f.context, f.state == State::kExited, next);
}

void fiber_main() {
#ifdef CUDA_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  Launch& l = *g_launch;
  Fiber& f = *l.current;
  race::acquire(&l.block_start);
  try {
    l.entry(l.call);
  } catch (const Failure&) {
  } catch (const std::exception& e) {
    record_failure(l, where(l, f) + ": exception: " + e.what());
  }
  race::release(&l.block_end);
  f.state = State::kExited;
  yield(l, f);
}

void* map_stack() {
  void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

// Thread order, or with CUDA_SIM_SCHEDULE=shuffle a permutation drawn per block (seeded by the
// block, so a failure repeats): a kernel that is missing a barrier gives a result that depends
// on which thread runs first, and the two orders tell such a kernel apart.
void choose_order(Launch& l, unsigned threads) {
  static const bool shuffle = [] {
    const char* schedule = std::getenv("CUDA_SIM_SCHEDULE");
    return schedule != nullptr && std::string(schedule) == "shuffle";
  }();
  l.order.resize(threads);
  for (unsigned i = 0; i < threads; ++i) l.order[i] = i;
  if (!shuffle) return;
  std::mt19937 gen(l.block_idx.x + 7919u * (l.block_idx.y + 7919u * l.block_idx.z));
  std::shuffle(l.order.begin(), l.order.end(), gen);
}

void start_fibers(Launch& l, unsigned threads) {
  if (g_fibers.size() < threads) g_fibers.resize(threads);
  choose_order(l, threads);
  l.warp_barrier.assign(2 * ((threads + kWarp - 1) / kWarp), 0);
  for (unsigned i = 0; i < threads; ++i) g_fibers[l.order[i]].turn = i;
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& f = g_fibers[i];
    if (f.stack == nullptr) f.stack = map_stack();
    if (f.race_fiber == nullptr) f.race_fiber = race::create(static_cast<int>(i));
    f.barriers_passed = f.warp_barriers_passed = 0;
#ifdef CUDA_SIM_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);  // an abandoned fiber may leave poisoned frames
#endif
    f.idx = uint3{i % l.block.x, i / l.block.x % l.block.y, i / (l.block.x * l.block.y)};
    f.linear = static_cast<int>(i);
    f.state = State::kRunnable;
    f.copies.clear();
    f.open_group = 0;
    make_context(f.context, f.stack, kStackBytes, fiber_main);
  }
}

// ---- Releasing collectives and barriers ---------------------------------------------------------
// Releases the collectives of warp w whose lanes have all arrived; false with l.error set when a
// lane of a mask can never arrive as the collective requires.
bool release_warp(Launch& l, int w, unsigned threads, bool& released) {
  std::vector<Fiber>& fibers = g_fibers;
  const int first = w * kWarp;
  const int lanes = std::min<int>(kWarp, static_cast<int>(threads) - first);
  for (int lane = 0; lane < lanes; ++lane) {
    const Fiber& leader = fibers[first + lane];
    if (leader.state != State::kInCollective) continue;
    const unsigned mask = leader.mask;
    bool ready = true;
    for (int m = 0; m < kWarp; ++m) {
      if (!(mask >> m & 1u)) continue;
      if (m >= lanes) {
        record_failure(l, where(l, leader) + ": " + leader.kind + "'s mask names lane " + std::to_string(m) +
                              ", which this block does not have");
        return false;
      }
      const Fiber& f = fibers[first + m];
      if (f.state == State::kExited) {
        record_failure(l, where(l, leader) + ": " + leader.kind + " waits for lane " + std::to_string(m) +
                              ", which has exited");
        return false;
      }
      if (f.state == State::kInCollective && (f.kind != leader.kind || f.mask != mask)) {
        record_failure(l, where(l, leader) + ": lanes of one warp wait in different collectives (" + leader.kind +
                              " and " + f.kind + ")");
        return false;
      }
      if (f.state != State::kInCollective) ready = false;
    }
    if (!ready) continue;
    const void* in[kWarp] = {};
    void* out[kWarp] = {};
    for (int m = 0; m < kWarp; ++m) {
      if (!(mask >> m & 1u)) continue;
      in[m] = fibers[first + m].in;
      out[m] = fibers[first + m].out;
    }
    leader.combine(in, out, mask, leader.arg);
    for (int m = 0; m < kWarp; ++m)
      if (mask >> m & 1u) fibers[first + m].state = State::kRunnable;
    released = true;
  }
  return true;
}

// Releases __syncthreads once every thread that has not exited waits there.
bool release_barrier(unsigned threads) {
  std::vector<Fiber>& fibers = g_fibers;
  int any = 0, waiting = 0;
  for (unsigned i = 0; i < threads; ++i) {
    if (fibers[i].state == State::kExited) continue;
    if (fibers[i].state != State::kAtBarrier) return false;
    any |= fibers[i].predicate;
    ++waiting;
  }
  if (waiting == 0) return false;
  for (unsigned i = 0; i < threads; ++i) {
    if (fibers[i].state != State::kAtBarrier) continue;
    fibers[i].state = State::kRunnable;
    fibers[i].predicate = any;
  }
  return true;
}

std::string deadlock(const Launch& l, unsigned threads) {
  std::ostringstream s;
  s << "block (" << l.block_idx.x << ',' << l.block_idx.y << ',' << l.block_idx.z << ") deadlocks:";
  const std::vector<Fiber>& fibers = g_fibers;
  for (unsigned i = 0; i < threads;) {  // runs of threads in the same state
    unsigned j = i;
    auto label = [&](const Fiber& f) {
      return f.state == State::kAtBarrier ? std::string("__syncthreads")
             : f.state == State::kInCollective ? std::string(f.kind)
                                               : std::string("exited");
    };
    while (j + 1 < threads && label(fibers[j + 1]) == label(fibers[i])) ++j;
    s << " threads " << i << '-' << j << ": " << label(fibers[i]) << ';';
    i = j + 1;
  }
  return s.str();
}

bool run_block(Launch& l, unsigned threads) {
  start_fibers(l, threads);
  l.shared = l.shared_bytes ? static_cast<unsigned char*>(::operator new(l.shared_bytes, std::align_val_t(128)))
                            : nullptr;
  if (l.shared) std::memset(l.shared, 0xff, l.shared_bytes);
  race::release(&l.block_start);  // the host's inputs, and the block before this one
  bool ok = true;
  for (;;) {
    Fiber* first = next_runnable(l, 0);
    const bool progressed = first != nullptr;
    if (first) transfer(l, l.scheduler, false, first);  // one pass
    ok = l.error.empty();
    bool live = false;
    for (unsigned i = 0; i < threads; ++i) live |= g_fibers[i].state != State::kExited;
    if (!ok || !live) break;
    bool released = false;
    for (unsigned w = 0; ok && w * kWarp < threads; ++w) ok = release_warp(l, static_cast<int>(w), threads, released);
    if (!ok) break;
    released |= release_barrier(threads);
    if (!released && !progressed) {
      record_failure(l, deadlock(l, threads));
      ok = false;
      break;
    }
  }
  for (unsigned i = 0; i < threads; ++i)
    if (g_fibers[i].state != State::kExited) race::release_for(g_fibers[i].race_fiber, &l.block_end);
  race::acquire(&l.block_end);
  if (l.shared) ::operator delete(l.shared, std::align_val_t(128));
  l.shared = nullptr;
  return ok;
}

void set_error(cudaError_t error, const std::string& message) {
  g_last_error = error;
  g_last_message = message;
  std::fprintf(stderr, "cuda_sim: %s\n", message.c_str());
}

// The reason a launch configuration is refused, or empty.
std::string check_config(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64)
    return "a block of " + std::to_string(block.x) + "x" + std::to_string(block.y) + "x" + std::to_string(block.z) +
           " threads";
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
    return "a grid of " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" + std::to_string(grid.z) +
           " blocks";
  const auto limit = g_shared_limits.find({t_device, kernel});
  const size_t allowed = limit == g_shared_limits.end() ? kDefaultSharedBytes : limit->second;
  if (shared_bytes > allowed)
    return std::to_string(shared_bytes) + " bytes of dynamic shared memory, past the kernel's " +
           std::to_string(allowed) + " (cudaFuncSetAttribute raises it)";
  return "";
}

// ---- Tensor-core fragments ------------------------------------------------------------------------
float half_bits_to_float(uint16_t bits, bool bf16) {
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

void combine_load_matrix(const void* const* in, void* const* out, unsigned, int trans) {
  auto row = [&](int r) { return *static_cast<const uint16_t* const*>(in[r]); };
  for (int lane = 0; lane < kWarp; ++lane) {
    const int g = lane / 4, t = lane % 4;
    auto& r = *static_cast<uint32_t(*)[4]>(out[lane]);
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = trans ? row(8 * i + 2 * t)[g] : row(8 * i + g)[2 * t];
      const uint16_t hi = trans ? row(8 * i + 2 * t + 1)[g] : row(8 * i + g)[2 * t + 1];
      r[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
}

struct MmaOperands {
  uint32_t a[4], b0, b1;
  float c[4];
};

void combine_mma(const void* const* in, void* const* out, unsigned, int bf16) {
  float a[16][16], b[16][8], c[16][8];
  auto lo = [&](uint32_t v) { return half_bits_to_float(static_cast<uint16_t>(v), bf16); };
  auto hi = [&](uint32_t v) { return half_bits_to_float(static_cast<uint16_t>(v >> 16), bf16); };
  for (int lane = 0; lane < kWarp; ++lane) {
    const MmaOperands& o = *static_cast<const MmaOperands*>(in[lane]);
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {  // A registers: rows g, g + 8, g, g + 8; columns +8 from register 2
      const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
      a[row][col] = lo(o.a[i]);
      a[row][col + 1] = hi(o.a[i]);
    }
    b[2 * t][g] = lo(o.b0);
    b[2 * t + 1][g] = hi(o.b0);
    b[2 * t + 8][g] = lo(o.b1);
    b[2 * t + 9][g] = hi(o.b1);
    for (int i = 0; i < 4; ++i) c[g + 8 * (i / 2)][2 * t + i % 2] = o.c[i];
  }
  // Products of 16-bit floats are exact in float; the sums round in k order (the hardware's order
  // and internal width are its own, so results may differ from a GPU's in the last bits).
  for (int row = 0; row < 16; ++row)
    for (int k = 0; k < 16; ++k)
      for (int col = 0; col < 8; ++col) c[row][col] += a[row][k] * b[k][col];
  for (int lane = 0; lane < kWarp; ++lane) {
    const int g = lane / 4, t = lane % 4;
    auto& d = *static_cast<float(*)[4]>(out[lane]);
    for (int i = 0; i < 4; ++i) d[i] = c[g + 8 * (i / 2)][2 * t + i % 2];
  }
}

}  // namespace

// ---- The interface of cuda_sim.h -----------------------------------------------------------------
const uint3& thread_idx() { return running().current->idx; }
const uint3& block_idx() { return running().block_idx; }
const dim3& block_dim() { return running().block; }
const dim3& grid_dim() { return running().grid; }
unsigned char* dynamic_shared_memory() { return running().shared; }

void fail(const char* why) {
  Launch& l = running();
  record_failure(l, where(l, *l.current) + ": " + why);
  throw Failure{};
}

void warp_collective(const char* kind, unsigned mask, const void* in, void* out, int arg, Combine combine) {
  Launch& l = running();
  Fiber& f = *l.current;
  if (!(mask >> (f.linear % kWarp) & 1u)) fail((std::string(kind) + " with a mask that leaves out its caller").c_str());
  f.kind = kind;
  f.mask = mask;
  f.in = in;
  f.out = out;
  f.arg = arg;
  f.combine = combine;
  f.state = State::kInCollective;
  yield(l, f);
}

void warp_barrier(unsigned mask) {
  Launch& l = running();
  Fiber& f = *l.current;
  char* sync = &l.warp_barrier[2 * (f.linear / kWarp) + f.warp_barriers_passed++ % 2];
  race::release(sync);
  int none = 0, unused = 0;
  warp_collective("__syncwarp", mask, &none, &unused, 0, [](const void* const*, void* const*, unsigned, int) {});
  race::acquire(sync);
}

int block_barrier(int predicate) {
  Launch& l = running();
  Fiber& f = *l.current;
  f.predicate = predicate;
  f.state = State::kAtBarrier;
  char* sync = &l.barrier[f.barriers_passed++ % 2];
  // A pending copy may land at any time until it is waited for.
  for (const Fiber::PendingCopy& copy : f.copies) race::write(copy.shared, 16);
  race::release(sync);
  yield(l, f);
  race::acquire(sync);
  return f.predicate;
}

void run_grid(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes, Entry entry, void* call) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const std::string refused = check_config(kernel, grid, block, shared_bytes);
  if (!refused.empty()) {
    set_error(cudaErrorInvalidConfiguration, "launch refused: " + refused);
    return;
  }
  Launch l;
  l.race_scheduler = race::current();
  l.entry = entry;
  l.call = call;
  l.grid = grid;
  l.block = block;
  l.shared_bytes = shared_bytes;
  g_launch = &l;
  const unsigned threads = block.x * block.y * block.z;
  l.threads = threads;
#ifdef CUDA_SIM_ASAN
  pthread_attr_t attr;  // the scheduler's stack: this thread's
  void* stack = nullptr;
  pthread_getattr_np(pthread_self(), &attr);
  pthread_attr_getstack(&attr, &stack, &l.scheduler_stack_bytes);
  pthread_attr_destroy(&attr);
  l.scheduler_stack = stack;
#endif
  bool ok = true;
  for (unsigned z = 0; ok && z < grid.z; ++z)
    for (unsigned y = 0; ok && y < grid.y; ++y)
      for (unsigned x = 0; ok && x < grid.x; ++x) {
        l.block_idx = uint3{x, y, z};
        ok = run_block(l, threads);
      }
  g_launch = nullptr;
  if (!ok) set_error(cudaErrorLaunchFailure, "kernel failed: " + l.error);
}

void load_matrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  Launch& l = running();
  const auto* p = static_cast<const unsigned char*>(row);
  if (p < l.shared || p + 16 > l.shared + l.shared_bytes) fail("ldmatrix reads a row outside dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail("ldmatrix reads a row that is not 16-byte aligned");
  race::read(p, 16);  // each lane names one row; the warp's combine reads them all
  warp_collective(trans ? "ldmatrix.trans" : "ldmatrix", 0xffffffffu, &row, &r, trans, combine_load_matrix);
}

void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  const MmaOperands o{{a[0], a[1], a[2], a[3]}, b0, b1, {d[0], d[1], d[2], d[3]}};
  warp_collective(bf16 ? "mma.bf16" : "mma.f16", 0xffffffffu, &o, &d, bf16, combine_mma);
}

void copy_async_16(void* shared, const void* global, bool zero) {
  Launch& l = running();
  auto* p = static_cast<unsigned char*>(shared);
  if (p < l.shared || p + 16 > l.shared + l.shared_bytes) fail("cp.async writes outside dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0 || reinterpret_cast<uintptr_t>(global) % 16 != 0)
    fail("cp.async of 16 bytes between addresses that are not 16-byte aligned");
  Fiber& f = *l.current;
  Fiber::PendingCopy copy{p, {}, f.open_group};
  race::write(p, 16);  // a GPU may write it from now on (and at each barrier before the wait, below)
  if (!zero) {
    race::read(global, 16);
    std::memcpy(copy.bytes, global, 16);
  }
  f.copies.push_back(copy);
}

void copy_async_commit() { ++running().current->open_group; }

void copy_async_wait(int n) {
  Fiber& f = *running().current;
  const int done_before = f.open_group - n;  // groups below this one complete
  size_t kept = 0;
  for (const Fiber::PendingCopy& copy : f.copies) {
    if (copy.group < done_before) {
      race::write(copy.shared, 16);  // lands now, as this fiber's write
      std::memcpy(copy.shared, copy.bytes, 16);
    }
    else f.copies[kept++] = copy;
  }
  f.copies.resize(kept);
}

int add_device(DeviceProperties properties) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_devices.push_back(properties);
  return static_cast<int>(g_devices.size()) - 1;
}

}  // namespace cuda_sim

// ---- The runtime API, on host memory --------------------------------------------------------------
using cuda_sim::g_mutex;

cudaError_t cudaGetDeviceCount(int* count) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *count = static_cast<int>(cuda_sim::g_devices.size());
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = cuda_sim::t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device < 0 || device >= static_cast<int>(cuda_sim::g_devices.size())) return cudaErrorInvalidDevice;
  cuda_sim::t_device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device < 0 || device >= static_cast<int>(cuda_sim::g_devices.size())) return cudaErrorInvalidDevice;
  const cuda_sim::DeviceProperties& properties = cuda_sim::g_devices[device];
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = static_cast<int>(cuda_sim::kMaxThreadsPerBlock); break;
    case cudaDevAttrMultiProcessorCount: *value = properties.multiprocessors; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = properties.shared_optin; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *ptr = ::operator new(bytes ? bytes : 1, std::align_val_t(256), std::nothrow);
  if (*ptr == nullptr) return cudaErrorMemoryAllocation;
  cuda_sim::allocations().insert(*ptr);
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (ptr == nullptr) return cudaSuccess;
  if (cuda_sim::allocations().erase(ptr) == 0) return cudaErrorInvalidDevicePointer;
  ::operator delete(ptr, std::align_val_t(256));
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  if (bytes) std::memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }  // launches run to the end before returning
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
// Unlike a device's sticky launch failures, the simulator's clear here, so a test can go on.
cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> lock(g_mutex);
  const cudaError_t error = cuda_sim::g_last_error;
  cuda_sim::g_last_error = cudaSuccess;
  return error;
}
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
// The last launch failure's own message (what went wrong, and where) for launch errors.
const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaErrorLaunchFailure || error == cudaErrorInvalidConfiguration)
    return cuda_sim::g_last_message.c_str();
  return cudaGetErrorName(error);
}
cudaError_t cuda_sim_set_shared_limit(const void* kernel, int bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (bytes < 0 || bytes > cuda_sim::g_devices[cuda_sim::t_device].shared_optin) return cudaErrorInvalidValue;
  cuda_sim::g_shared_limits[{cuda_sim::t_device, kernel}] = static_cast<size_t>(bytes);
  return cudaSuccess;
}
