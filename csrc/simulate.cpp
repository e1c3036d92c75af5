#include "simulate.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

namespace moesub {

static void add(Counters& into, const Counters& c) {
  into.tokens += c.tokens;
  into.hit += c.hit;
  into.fetch += c.fetch;
  into.sub += c.sub;
  into.host += c.host;
  into.forced += c.forced;
  into.admission_requests += c.admission_requests;
  into.admissions += c.admissions;
  into.evictions += c.evictions;
  into.prefetches += c.prefetches;
  into.rerouted += c.rerouted;
}

// One layer of one stream through every grid point. Selection does not depend on the policy, so
// each token's top-k and gate weights are computed once and shared by all G caches.
static void run_task(const StreamView& s, int64_t offset, int L, int E, int k,
                     const std::vector<GridPoint>& points, int layer,
                     const std::vector<double*>& mass, Counters* counters, int64_t* belady,
                     const double* coactivation) {
  const int64_t row_stride = static_cast<int64_t>(L) * E;
  const float* logits = s.logits + static_cast<int64_t>(layer) * E;
  const float* lookahead = s.lookahead ? s.lookahead + static_cast<int64_t>(layer) * E : nullptr;
  bool any_belady = false;
  for (const GridPoint& gp : points) any_belady |= gp.policy.eviction == Eviction::Belady;
  Future future;  // one per task, shared by every belady point
  if (any_belady) future = layer_future(logits, s.T, row_stride, E, k);
  std::vector<LayerCache> caches;
  std::vector<StepOut> outs;
  for (size_t g = 0; g < points.size(); ++g) {
    const GridPoint& gp = points[g];
    PolicyParams policy = gp.policy;
    policy.pin = gp.pin[layer];
    caches.emplace_back(E, k, gp.capacity[layer], policy, gp.initial[layer], false);
    if (coactivation) caches.back().set_coactivation(coactivation + static_cast<int64_t>(layer) * E * E);
    if (gp.policy.eviction == Eviction::Belady) caches.back().set_future(&future);
    StepOut out;
    out.mass = mass[g] + offset * L + layer;
    out.mass_stride = L;
    if (gp.counts) {
      out.counts = gp.counts + (offset * L + layer) * kTokenLayerFields;
      out.counts_stride = static_cast<int64_t>(L) * kTokenLayerFields;
    }
    outs.push_back(out);
  }
  // the lookahead's top-n for the largest prefetch of the grid: each point takes its prefix
  int n_pref = 0;
  bool bias = false;  // some point needs each row's smallest logit (route_bias)
  for (const GridPoint& gp : points) {
    n_pref = std::max(n_pref, gp.policy.prefetch);
    bias |= gp.policy.route_bias > 0.0;
  }
  if (!lookahead) n_pref = 0;
  constexpr int64_t kChunk = 16;  // tokens selected together, for batched gate weights
  int32_t sel[kChunk * kMaxTopK];
  float vals[kChunk * kMaxTopK];
  double w[kChunk * kMaxTopK];
  float zmin[kChunk] = {};
  std::vector<int32_t> pref(std::max(n_pref, 1));
  std::vector<float> pref_vals(std::max(n_pref, 1));
  for (int64_t t0 = 0; t0 < s.T; t0 += kChunk) {
    const int64_t n = std::min(kChunk, s.T - t0);
    for (int64_t i = 0; i < n; ++i)
      if (!select_topk(logits + (t0 + i) * row_stride, E, k, sel + i * k, vals + i * k,
                       bias ? &zmin[i] : nullptr))
        throw NonFiniteLogits(t0 + i);
    gate_weights(vals, n, k, w);
    for (int64_t i = 0; i < n; ++i) {
      const float* z = logits + (t0 + i) * row_stride;
      if (n_pref && !select_topk(lookahead + (t0 + i) * row_stride, E, n_pref, pref.data(),
                                 pref_vals.data()))
        throw NonFiniteLookahead(t0 + i);
      for (size_t g = 0; g < caches.size(); ++g)
        caches[g].step_selected(z, sel + i * k, w + i * k, outs[g], t0 + i,
                                n_pref ? pref.data() : nullptr, zmin[i]);
    }
  }
  for (size_t g = 0; g < points.size(); ++g) {
    add(counters[g * L + layer], caches[g].counters());
    if (points[g].belady)
      belady[g * L + layer] += belady_hits(logits, s.T, row_stride, E, k,
                                           points[g].capacity[layer], points[g].initial[layer]);
  }
}

void simulate_grid(const std::vector<StreamView>& streams, int L, int E, int k,
                   const std::vector<GridPoint>& points, int n_threads, Counters* counters,
                   const std::vector<double*>& mass, int64_t* belady,
                   const double* coactivation) {
  // Tasks are (stream, layer) pairs; each writes its own counters, summed in task order, so the
  // result is the same for any number of threads.
  const int64_t G = static_cast<int64_t>(points.size());
  const int64_t n_tasks = static_cast<int64_t>(streams.size()) * L;
  std::vector<int64_t> offset(streams.size(), 0);  // first token of each stream in `mass`
  for (size_t i = 1; i < streams.size(); ++i) offset[i] = offset[i - 1] + streams[i - 1].T;
  std::vector<Counters> task_counters(n_tasks * G * L);
  std::vector<int64_t> task_belady(n_tasks * G * L, 0);
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (int64_t task = next++; task < n_tasks; task = next++) {
      const int64_t i = task / L;
      const int layer = static_cast<int>(task % L);
      try {
        run_task(streams[i], offset[i], L, E, k, points, layer, mass,
                 &task_counters[task * G * L], &task_belady[task * G * L], coactivation);
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
  for (int64_t task = 0; task < n_tasks; ++task)
    for (int64_t j = 0; j < G * L; ++j) {
      add(counters[j], task_counters[task * G * L + j]);
      belady[j] += task_belady[task * G * L + j];
    }
}

}  // namespace moesub
