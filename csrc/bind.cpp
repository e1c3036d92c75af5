// nanobind bindings of the policy core. Python (moesub.policy / moesub.simulate) validates the
// arguments and allocates the output arrays; these functions fill them with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "policy.hpp"
#include "simulate.hpp"

namespace nb = nanobind;
using namespace moesub;

template <typename T, size_t N>
using Array = nb::ndarray<T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

static PolicyParams make_policy(int rule, double tau, int eviction, double beta, int64_t delay) {
  PolicyParams p;
  p.rule = static_cast<Rule>(rule);
  p.tau = tau;
  p.eviction = static_cast<Eviction>(eviction);
  p.beta = beta;
  p.delay = delay;
  return p;
}

static nb::dict counters_dict(const Counters& c) {
  nb::dict d;
  d["tokens"] = c.tokens;
  d["hit"] = c.hit;
  d["fetch"] = c.fetch;
  d["sub"] = c.sub;
  d["host"] = c.host;
  d["forced"] = c.forced;
  d["admission_requests"] = c.admission_requests;
  d["admissions"] = c.admissions;
  d["evictions"] = c.evictions;
  return d;
}

NB_MODULE(_core, m) {
  m.doc() = "moesub policy core (C++): per-layer expert cache, substitution and admission";
  m.attr("BUILD_ID") = MOESUB_BUILD_ID;
  m.attr("MAX_TOP_K") = kMaxTopK;

  nb::class_<LayerCache>(m, "LayerCache")
      .def(
          "__init__",
          [](LayerCache* self, int E, int k, int C, int rule, double tau, int eviction, double beta,
             int64_t delay, std::optional<Array<const int32_t, 1>> initial, bool external) {
            new (self) LayerCache(E, k, C, make_policy(rule, tau, eviction, beta, delay),
                                  initial ? initial->data() : nullptr, external);
          },
          nb::arg("num_experts"), nb::arg("k"), nb::arg("capacity"), nb::arg("rule"),
          nb::arg("tau"), nb::arg("eviction"), nb::arg("beta"), nb::arg("delay"),
          nb::arg("initial").none(), nb::arg("external_admission"))
      .def(
          "step",
          [](LayerCache& self, Array<const float, 2> logits, Array<int32_t, 2> ids,
             Array<double, 2> weights, Array<int8_t, 2> status, Array<int32_t, 2> selected,
             Array<int32_t, 2> slot, Array<double, 1> mass) {
            std::vector<std::pair<int64_t, int32_t>> admissions;
            StepOut out{ids.data(), weights.data(), status.data(), selected.data(), slot.data(),
                        static_cast<int64_t>(ids.shape(1)), mass.data(), 1, &admissions};
            {
              nb::gil_scoped_release release;
              self.step(logits.data(), logits.shape(0), logits.shape(1), out);
            }
            return admissions;
          })
      .def("admit", &LayerCache::admit, nb::arg("expert"))
      .def("resident", [](const LayerCache& self) { return self.resident(); })
      .def("counters", [](const LayerCache& self) { return counters_dict(self.counters()); })
      .def("pending", &LayerCache::pending, nb::arg("expert"))
      .def_prop_ro("t", &LayerCache::t);

  // Whole-stream scan of a (T, L, E) trace into (T, L, k) outputs, token by token: the top-k of
  // all L rows of a token first (the trace is read front to back), then each layer's cache.
  // A NaN/inf logit raises ValueError naming its (token, layer, expert); outputs are then junk.
  m.def("scan",
        [](Array<const float, 3> logits, int k, int C, int rule, double tau, int eviction,
           double beta, int64_t delay, std::optional<Array<const int32_t, 2>> initial,
           Array<int32_t, 3> ids, Array<double, 3> weights, Array<int8_t, 3> status,
           Array<int32_t, 3> selected, Array<double, 2> mass) {
          const int64_t T = logits.shape(0), L = logits.shape(1), E = logits.shape(2);
          const PolicyParams p = make_policy(rule, tau, eviction, beta, delay);
          const int32_t* init = initial ? initial->data() : nullptr;
          nb::gil_scoped_release release;
          std::vector<LayerCache> caches;
          std::vector<StepOut> outs;
          for (int64_t l = 0; l < L; ++l) {
            caches.emplace_back(static_cast<int>(E), k, C, p, init ? init + l * C : nullptr, false);
            outs.push_back({ids.data() + l * k, weights.data() + l * k, status.data() + l * k,
                            selected.data() + l * k, nullptr, L * k, mass.data() + l, L, nullptr});
          }
          std::vector<int32_t> sel(L * k);
          std::vector<float> vals(L * k);
          std::vector<double> w(L * k);
          for (int64_t t = 0; t < T; ++t) {
            const float* rows = logits.data() + t * L * E;
            for (int64_t l = 0; l < L; ++l) {
              const float* z = rows + l * E;
              if (!select_topk(z, static_cast<int>(E), k, &sel[l * k], &vals[l * k])) {
                int64_t e = 0;
                while (std::isfinite(z[e])) ++e;
                throw std::invalid_argument("logits: contain NaN or inf (at index (" +
                                            std::to_string(t) + ", " + std::to_string(l) + ", " +
                                            std::to_string(e) + "))");
              }
            }
            gate_weights(vals.data(), L, k, w.data());
            for (int64_t l = 0; l < L; ++l)
              caches[l].step_selected(rows + l * E, &sel[l * k], &w[l * k], outs[l], t);
          }
        });

  m.def("forced_substitution",
        [](Array<const float, 2> logits, int k, Array<const int32_t, 1> resident,
           Array<const uint8_t, 2> sub_mask, Array<int32_t, 2> ids, Array<double, 2> weights,
           Array<int32_t, 2> selected) {
          nb::gil_scoped_release release;
          forced_substitution(logits.data(), logits.shape(0), static_cast<int>(logits.shape(1)), k,
                              resident.data(), static_cast<int>(resident.shape(0)),
                              sub_mask.data(), ids.data(), weights.data(), selected.data());
        });

  // Grid simulation. Per grid point g: rule/tau/eviction/beta/delay/capacity/initial/belady.
  // Returns (counters (G, L, 9) int64 in Counters order, belady hits (G, L)); fills mass[g].
  m.def("simulate_grid",
        [](std::vector<Array<const float, 3>> streams, int k, std::vector<int> rules,
           std::vector<double> taus, std::vector<int> evictions, std::vector<double> betas,
           std::vector<int64_t> delays, std::vector<int> capacities,
           std::vector<std::optional<Array<const int32_t, 2>>> initials, std::vector<bool> belady,
           std::vector<Array<double, 2>> mass, Array<int64_t, 3> counters_out,
           Array<int64_t, 2> belady_out, int n_threads) {
          const int L = static_cast<int>(streams.at(0).shape(1));
          const int E = static_cast<int>(streams.at(0).shape(2));
          std::vector<StreamView> views;
          for (auto& s : streams) views.push_back({s.data(), static_cast<int64_t>(s.shape(0))});
          std::vector<GridPoint> points(rules.size());
          std::vector<double*> mass_ptrs;
          for (size_t g = 0; g < rules.size(); ++g) {
            points[g].policy = make_policy(rules[g], taus[g], evictions[g], betas[g], delays[g]);
            points[g].capacity = capacities[g];
            points[g].initial = initials[g] ? initials[g]->data() : nullptr;
            points[g].belady = belady[g];
            mass_ptrs.push_back(mass[g].data());
          }
          std::vector<Counters> counters(points.size() * L);
          {
            nb::gil_scoped_release release;
            simulate_grid(views, L, E, k, points, n_threads, counters.data(), mass_ptrs,
                          belady_out.data());
          }
          int64_t* c = counters_out.data();
          for (const Counters& x : counters) {
            const int64_t row[9] = {x.tokens, x.hit, x.fetch, x.sub, x.host, x.forced,
                                    x.admission_requests, x.admissions, x.evictions};
            std::copy(row, row + 9, c);
            c += 9;
          }
        });
}
