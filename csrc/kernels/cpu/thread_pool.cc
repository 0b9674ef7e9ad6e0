#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "octavo/status.h"
#include "octavo/threading.h"

namespace octavo {
namespace {

// Spin iterations a worker waits for the next job before sleeping: about 50 µs, long enough to
// bridge the gap between two kernels of one forward pass, short enough not to steal the cores
// from torch's GEMMs for long.
constexpr int kSpinIterations = 20000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int default_num_threads() {
  if (const char* env = std::getenv("OCTAVO_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

thread_local bool t_inside_kernel = false;

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) { start(num_threads); }
  ~ThreadPool() { stop(); }

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int num_threads) {
    std::lock_guard<std::mutex> owner(owner_);
    stop();
    start(num_threads);
  }

  void run(int64_t n, int64_t grain, ParallelFn fn, void* ctx) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (!owner.owns_lock() || t_inside_kernel || workers_.empty() || n <= grain) {
      run_serial(n, grain, fn, ctx);
      return;
    }
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    grain_ = grain;
    error_ = nullptr;
    next_.store(0, std::memory_order_relaxed);
    busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    while (busy_.load(std::memory_order_acquire) != 0) cpu_relax();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static void run_serial(int64_t n, int64_t grain, ParallelFn fn, void* ctx) {
    const bool outer = t_inside_kernel;
    t_inside_kernel = true;
    try {
      for (int64_t begin = 0; begin < n; begin += grain) fn(ctx, begin, std::min(n, begin + grain));
    } catch (...) {
      t_inside_kernel = outer;
      throw;
    }
    t_inside_kernel = outer;
  }

  void start(int num_threads) {
    quit_ = false;
    // Read here, not in the new thread: a job posted before the thread runs must not be missed.
    const uint64_t seen = generation_.load(std::memory_order_acquire);
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, seen] { worker_loop(seen); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  // Takes chunks until none are left. Any thread of the pool (the caller too) runs this.
  void work() {
    t_inside_kernel = true;
    for (;;) {
      const int64_t begin = next_.fetch_add(grain_, std::memory_order_relaxed);
      if (begin >= n_) break;
      try {
        fn_(ctx_, begin, std::min(n_, begin + grain_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    t_inside_kernel = false;
  }

  void worker_loop(uint64_t seen) {
    for (;;) {
      uint64_t now = seen;
      for (int i = 0; i < kSpinIterations && now == seen; ++i) {
        cpu_relax();
        now = generation_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (quit_) return;
      work();
      busy_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex owner_;  // held by the thread whose parallel_for is running
  std::mutex mu_;     // guards sleeping, quit_ and error_
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};  // bumped once per job (and on stop)
  std::atomic<int64_t> next_{0};         // first item not yet taken
  std::atomic<int> busy_{0};             // workers still inside the current job
  bool quit_ = false;
  ParallelFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool* instance = new ThreadPool(default_num_threads());  // never destroyed: workers
  return *instance;                                                    // may outlive static dtors
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

struct Scratch {
  std::unique_ptr<void, AlignedFree> data;
  size_t bytes = 0;
};

}  // namespace

int get_num_threads() { return pool().num_threads(); }

void set_num_threads(int n) {
  OCTAVO_CHECK(n >= 1, "num_threads must be at least 1, got " << n);
  OCTAVO_CHECK(!t_inside_kernel, "set_num_threads() cannot be called from inside a kernel");
  if (n != pool().num_threads()) pool().resize(n);
}

void parallel_for(int64_t n, int64_t grain, ParallelFn fn, void* ctx) {
  pool().run(n, std::max<int64_t>(1, grain), fn, ctx);
}

void* thread_scratch(int slot, size_t bytes) {
  OCTAVO_CHECK(slot >= 0 && slot < kNumScratchSlots, "scratch slot " << slot << " out of range");
  thread_local Scratch scratch[kNumScratchSlots];
  Scratch& s = scratch[slot];
  if (s.bytes < bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    OCTAVO_CHECK_KIND(ErrorKind::kRuntime, p != nullptr, "out of memory allocating " << rounded << " bytes of scratch");
    s.data.reset(p);
    s.bytes = rounded;
  }
  return s.data.get();
}

}  // namespace octavo
