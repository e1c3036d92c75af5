// Trace-driven simulator: a grid of (policy, capacity) points replayed over router-logit streams,
// one task per (stream, layer) that steps every grid point from one shared top-k per token,
// spread over threads. Caches restart at every stream.
#pragma once

#include <cstdint>
#include <vector>

#include "policy.hpp"

namespace moesub {

struct GridPoint {
  PolicyParams policy;                  // its pin is replaced by pin[l] in layer l
  std::vector<int> capacity;            // L: slots per layer
  std::vector<int> pin;                 // L: pinned experts per layer
  std::vector<const int32_t*> initial;  // L: capacity[l] experts each, or null: 0..C_l-1
  bool belady = false;                  // also compute the optimal-eviction hit count
  int16_t* counts = nullptr;  // (sum of T, L, kTokenLayerFields) per token-layer, or null
};

struct StreamView {
  const float* logits;  // (T, L, E)
  int64_t T;
  const float* lookahead = nullptr;  // (T, L, E) lookahead logits, or null (no prefetch)
};

// counters: G*L entries; mass[g]: (sum of T, L) substituted mass; belady: G*L hit counts;
// streams follow each other in mass and counts.
// coactivation: (L, E, E) table for substitute_by = coactivation, or null.
void simulate_grid(const std::vector<StreamView>& streams, int L, int E, int k,
                   const std::vector<GridPoint>& points, int n_threads, Counters* counters,
                   const std::vector<double*>& mass, int64_t* belady,
                   const double* coactivation = nullptr);

}  // namespace moesub
