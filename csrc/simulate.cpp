#include "simulate.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

namespace moesub {

static void run_task(const std::vector<StreamView>& streams, int L, int E, int k,
                     const GridPoint& gp, int layer, Counters* counters, double* mass,
                     int64_t* belady) {
  const int32_t* initial = gp.initial ? gp.initial + static_cast<int64_t>(layer) * gp.capacity : nullptr;
  int64_t offset = 0;  // first token of the stream in the concatenated mass array
  for (const StreamView& s : streams) {
    LayerCache cache(E, k, gp.capacity, gp.policy, initial, false);
    StepOut out;
    out.mass = mass + offset * L + layer;
    out.mass_stride = L;
    const float* logits = s.logits + static_cast<int64_t>(layer) * E;
    cache.step(logits, s.T, static_cast<int64_t>(L) * E, out);
    const Counters& c = cache.counters();
    counters->tokens += c.tokens;
    counters->hit += c.hit;
    counters->fetch += c.fetch;
    counters->sub += c.sub;
    counters->host += c.host;
    counters->forced += c.forced;
    counters->admission_requests += c.admission_requests;
    counters->admissions += c.admissions;
    counters->evictions += c.evictions;
    if (belady) *belady += belady_hits(logits, s.T, static_cast<int64_t>(L) * E, E, k, gp.capacity, initial);
    offset += s.T;
  }
}

void simulate_grid(const std::vector<StreamView>& streams, int L, int E, int k,
                   const std::vector<GridPoint>& points, int n_threads, Counters* counters,
                   const std::vector<double*>& mass, int64_t* belady) {
  const int64_t n_tasks = static_cast<int64_t>(points.size()) * L;
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (int64_t task = next++; task < n_tasks; task = next++) {
      const int64_t g = task / L;
      const int layer = static_cast<int>(task % L);
      try {
        run_task(streams, L, E, k, points[g], layer, counters + task, mass[g],
                 points[g].belady ? belady + task : nullptr);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  };
  const int n = std::max(1, std::min<int>(n_threads, static_cast<int>(n_tasks)));
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) threads.emplace_back(worker);
  worker();
  for (auto& th : threads) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace moesub
