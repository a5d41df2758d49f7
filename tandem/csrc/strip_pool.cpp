// A claim-based thread pool for small steps' linears (CPU).
//
// Why: a decode step of a few rows is memory-bound (it streams every weight once), so two
// cores nearly halve it (1 row of the `small` model on this host: 13.3 ms on one thread,
// 7.6 ms on two, alone). But torch's OpenMP regions fork and join: every region waits for
// its slowest thread, and on cores shared with the router, the encoder and clients a
// thread that was descheduled stalls the whole step (mixed c=1 TPOT 17.4 ms on two OpenMP
// threads vs 13.9 ms on one, in serving). Here the caller never waits for a helper that has
// not started: the job's tasks (column strips) are claimed one at a time from a counter by
// the caller and by the helpers alike; the caller then waits only for tasks a helper has
// already claimed and is running. A helper that arrives late finds nothing left.
//
// Protocol (one caller at a time: `busy`; another caller falls back to running alone):
//   caller: job fn/n stored; counter = (gen+1, 0); gen = gen+1 (wake sleepers);
//           claim tasks until none is left; wait until done == n; seal: counter =
//           (gen, kSealed), so no task of this generation can be claimed any more.
//   helper: sees gen change (spinning for kSpinNs after its last job, then asleep on a futex);
//           reads fn/n; claims by CAS on counter, which fails once the counter's
//           generation is not the one it read, so a helper that woke late never runs a
//           task of a job that is over or of the next one; runs it; done += 1.
// Every task a helper claims belongs to the current job, and the caller does not publish
// another job before done == n, so no increment of `done` crosses jobs.
// Why the seal: a helper reads gen, then fn, then n, each on its own. Without the seal, a
// helper that read gen == g late could read the *next* job's n (stored before the next
// counter and gen) while the counter still said (g, n_g); with n_next > n_g its claim
// succeeded and it ran task n_g of job g's finished fn: a strip past the end of job g's
// output, written through a dangling std::function (CI saw it as a segfault). Sealed, a
// counter of generation g has no claimable task once job g is over, whatever n a late
// helper read, and the next job's fn and n are stored only after the seal.
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <pthread.h>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() std::this_thread::yield()
#endif

namespace {


using Task = std::function<void(int64_t)>;

// Sleep while *word == seen / wake every sleeper (a futex on Linux; C++17 has no
// atomic wait). std::atomic<uint32_t> is a plain 32-bit word here (static_assert below).
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr,
          nullptr, 0);
#else
  while (word->load() == seen) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex needs a plain word");

// The counter's task field once a job is over: no total reaches it (run() refuses 2^32).
constexpr uint64_t kSealed = 0xffffffffu;

struct Pool {
  std::atomic<uint32_t> gen{0};
  std::atomic<uint64_t> counter{0};  // (generation << 32) | next task
  std::atomic<const Task*> fn{nullptr};
  std::atomic<int64_t> n{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> sleeping{0};
  std::atomic<bool> stop{false};
  // How long a helper spins after a job before it sleeps: longer than the gaps between one
  // step's linears, shorter than the gaps between steps.
  std::atomic<int64_t> spin_ns{100'000};
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  std::vector<std::thread> helpers;

  // Claim the next task of generation g; -1 when the job is over (or not g's any more).
  int64_t claim(uint32_t g, int64_t total) {
    uint64_t c = counter.load();
    while (true) {
      if (static_cast<uint32_t>(c >> 32) != g || static_cast<int64_t>(c & 0xffffffffu) >= total)
        return -1;
      if (counter.compare_exchange_weak(c, c + 1)) return static_cast<int64_t>(c & 0xffffffffu);
    }
  }

  void helper_loop() {
    uint32_t seen = gen.load();
    while (!stop.load()) {
      auto start = std::chrono::steady_clock::now();
      uint32_t g = gen.load();
      for (int spins = 0; g == seen && !stop.load(); ++spins) {
        POOL_PAUSE();
        if ((spins & 63) == 63 &&
            std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(spin_ns.load())) {
          sleeping.fetch_add(1);
          futex_wait(&gen, seen);  // returns at once if gen moved meanwhile
          sleeping.fetch_sub(1);
          start = std::chrono::steady_clock::now();
        }
        g = gen.load();
      }
      if (stop.load()) return;
      seen = g;
      const Task* f = fn.load();
      const int64_t total = n.load();
      for (int64_t i; (i = claim(g, total)) >= 0;) {
        (*f)(i);
        done.fetch_add(1);
      }
    }
  }

  ~Pool() { resize(0); }

  void resize(int count) {
    stop.store(true);
    gen.fetch_add(1);
    futex_wake_all(&gen);
    for (auto& t : helpers) t.join();
    helpers.clear();
    stop.store(false);
    for (int i = 0; i < count; ++i) helpers.emplace_back([this] { helper_loop(); });
  }
};

Pool& pool();

// A child forked after the helpers started has none of their threads: it forgets them
// (their handles are leaked, never joined) and runs alone until set_helpers is called.
void forget_helpers_after_fork() {
  Pool& p = pool();
  new std::vector<std::thread>(std::move(p.helpers));  // NOTE: leaked on purpose
  p.helpers.clear();
  p.sleeping.store(0);
  p.busy.clear();
}

Pool& pool() {
  static Pool p;
  static const int registered = pthread_atfork(nullptr, nullptr, forget_helpers_after_fork);
  (void)registered;
  return p;
}

}  // namespace

namespace strip_pool {

void set_helpers(int64_t count, int64_t spin_us) {
  TORCH_CHECK(count >= 0 && count <= 256, "helpers must be in [0, 256]");
  TORCH_CHECK(spin_us >= 0 && spin_us <= 1'000'000, "spin_us must be in [0, 1e6]");
  Pool& p = pool();
  p.spin_ns.store(spin_us * 1000);
  while (p.busy.test_and_set()) std::this_thread::yield();
  p.resize(static_cast<int>(count));
  p.busy.clear();
}

int64_t helpers() { return static_cast<int64_t>(pool().helpers.size()); }

// Run fn(i) for every i in [0, total) on the caller and the helpers; false (nothing run)
// when there are no helpers or another caller holds the pool.
bool run(int64_t total, const Task& task) {
  Pool& p = pool();
  if (p.helpers.empty() || total <= 1 || total >= (int64_t{1} << 32)) return false;
  if (p.busy.test_and_set()) return false;
  const uint32_t g = p.gen.load() + 1;
  p.fn.store(&task);
  p.n.store(total);
  p.done.store(0);
  p.counter.store(static_cast<uint64_t>(g) << 32);
  p.gen.store(g);
  if (p.sleeping.load() > 0) futex_wake_all(&p.gen);
  int64_t mine = 0;
  for (int64_t i; (i = p.claim(g, total)) >= 0; ++mine) task(i);
  while (p.done.load() + mine < total) POOL_PAUSE();
  p.counter.store((static_cast<uint64_t>(g) << 32) | kSealed);
  p.busy.clear();
  return true;
}

// The protocol's own check: `jobs` back-to-back jobs of alternating sizes with tasks too
// small to hide a race, every job's task and tally kept alive to the end (so a task run
// outside its job is counted instead of crashing). Returns how many tasks ran with an
// index outside their job or how many indices ran other than once: 0 when the protocol
// holds. Needs helpers (set_helpers); a job the pool refuses (busy) is run alone.
int64_t selftest(int64_t jobs) {
  TORCH_CHECK(!pool().helpers.empty(), "selftest needs helpers (set_pool_helpers)");
  TORCH_CHECK(jobs > 0 && jobs <= 1'000'000, "jobs must be in [1, 1e6]");
  static constexpr int64_t kSizes[] = {2, 67, 3, 130, 5, 33, 2, 9};
  std::vector<std::vector<std::atomic<int>>> tallies;
  std::vector<Task> tasks;
  std::atomic<int64_t> outside{0};
  tallies.reserve(jobs);
  tasks.reserve(jobs);
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t total = kSizes[j % 8];
    tallies.emplace_back(total);
    auto* tally = &tallies.back();
    tasks.emplace_back([tally, total, &outside](int64_t i) {
      if (i < 0 || i >= total)
        outside.fetch_add(1);
      else
        (*tally)[i].fetch_add(1);
    });
    if (!run(total, tasks.back()))
      for (int64_t i = 0; i < total; ++i) tasks.back()(i);
  }
  int64_t bad = outside.load();
  for (auto& tally : tallies)
    for (auto& n : tally) bad += n.load() != 1;
  return bad;
}

}  // namespace strip_pool
