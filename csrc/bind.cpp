// nanobind bindings of the policy core. Python (moesub.policy / moesub.simulate) validates the
// arguments and allocates the output arrays; these functions fill them with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "policy.hpp"
#include "pricing.hpp"
#include "simulate.hpp"

namespace nb = nanobind;
using namespace moesub;

template <typename T, size_t N>
using Array = nb::ndarray<T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

// A policy as moesub.policy.Policy._core_args() passes it: v1 fields, then v2, then v3's
// host_admit; the pin comes apart, per layer.
using PolicyArgs = std::tuple<int, double, int, double, int64_t, int, double, int, int, int>;

static PolicyParams make_policy(const PolicyArgs& a, int pin = 0) {
  PolicyParams p;
  p.rule = static_cast<Rule>(std::get<0>(a));
  p.tau = std::get<1>(a);
  p.eviction = static_cast<Eviction>(std::get<2>(a));
  p.beta = std::get<3>(a);
  p.delay = std::get<4>(a);
  p.prefetch = std::get<5>(a);
  p.route_bias = std::get<6>(a);
  p.light_miss = static_cast<LightMiss>(std::get<7>(a));
  p.substitute_by = static_cast<SubstituteBy>(std::get<8>(a));
  p.host_admit = std::get<9>(a);
  p.pin = pin;
  return p;
}

// "<what>: contain NaN or inf (at index (t, l, e))" for the first non-finite entry of row z.
static std::invalid_argument non_finite(const char* what, int64_t t, int64_t l, const float* z) {
  int64_t e = 0;
  while (std::isfinite(z[e])) ++e;
  return std::invalid_argument(std::string(what) + ": contain NaN or inf (at index (" +
                               std::to_string(t) + ", " + std::to_string(l) + ", " +
                               std::to_string(e) + "))");
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
  d["prefetches"] = c.prefetches;
  d["rerouted"] = c.rerouted;
  return d;
}

NB_MODULE(_core, m) {
  m.doc() = "moesub policy core (C++): per-layer expert cache, substitution and admission";
  m.attr("BUILD_ID") = MOESUB_BUILD_ID;
  m.attr("MAX_TOP_K") = kMaxTopK;

  nb::class_<LayerCache>(m, "LayerCache")
      .def(
          "__init__",
          [](LayerCache* self, int E, int k, int C, PolicyArgs policy, int pin,
             std::optional<Array<const int32_t, 1>> initial, bool external,
             std::optional<Array<const double, 2>> coactivation) {
            const PolicyParams p = make_policy(policy, pin);
            if (p.eviction == Eviction::Belady)
              throw std::invalid_argument(
                  "policy eviction 'belady' needs the whole stream's future: scan and the "
                  "simulator only, not the streaming LayerCache");
            new (self) LayerCache(E, k, C, p, initial ? initial->data() : nullptr, external);
            if (coactivation) self->set_coactivation(coactivation->data());
          },
          nb::arg("num_experts"), nb::arg("k"), nb::arg("capacity"), nb::arg("policy"),
          nb::arg("pin"), nb::arg("initial").none(), nb::arg("external_admission"),
          nb::arg("coactivation").none())
      .def(
          "step",
          [](LayerCache& self, Array<const float, 2> logits,
             std::optional<Array<const float, 2>> lookahead, Array<int32_t, 2> ids,
             Array<double, 2> weights, Array<int8_t, 2> status, Array<int32_t, 2> selected,
             Array<int32_t, 2> slot, Array<double, 1> mass, Array<double, 1> rerouted,
             Array<int32_t, 1> prefetched, Array<int32_t, 1> requested,
             Array<int32_t, 1> admitted) {
            std::vector<std::pair<int64_t, int32_t>> admissions;
            StepOut out{ids.data(), weights.data(), status.data(), selected.data(), slot.data(),
                        static_cast<int64_t>(ids.shape(1)), mass.data(), 1, rerouted.data(),
                        prefetched.data(), &admissions, requested.data(), admitted.data()};
            {
              nb::gil_scoped_release release;
              self.step(logits.data(), logits.shape(0), logits.shape(1), out,
                        lookahead ? lookahead->data() : nullptr,
                        lookahead ? lookahead->shape(1) : 0);
            }
            return admissions;
          },
          nb::arg("logits"), nb::arg("lookahead").none(), nb::arg("ids"), nb::arg("weights"),
          nb::arg("status"), nb::arg("selected"), nb::arg("slot"), nb::arg("mass"),
          nb::arg("rerouted"), nb::arg("prefetched"), nb::arg("requested"), nb::arg("admitted"))
      .def("admit", &LayerCache::admit, nb::arg("expert"))
      .def("resident", [](const LayerCache& self) { return self.resident(); })
      .def("counters", [](const LayerCache& self) { return counters_dict(self.counters()); })
      .def("pending", &LayerCache::pending, nb::arg("expert"))
      .def_prop_ro("t", &LayerCache::t);

  // Whole-stream scan of a (T, L, E) trace into (T, L, k) outputs, token by token: the top-k of
  // all L rows of a token first (the trace is read front to back), then each layer's cache.
  // Per layer l: capacities[l] slots, pins[l] pinned, initials[l] (capacities[l] experts).
  // A NaN/inf logit raises ValueError naming its (token, layer, expert); outputs are then junk.
  // Belady's eviction first reads every layer's future (a pass of top-k over the whole trace).
  m.def("scan",
        [](Array<const float, 3> logits, int k, std::vector<int> capacities, PolicyArgs policy,
           std::vector<int> pins, std::vector<Array<const int32_t, 1>> initials,
           std::optional<Array<const float, 3>> lookahead,
           std::optional<Array<const double, 3>> coactivation, Array<int32_t, 3> ids,
           Array<double, 3> weights, Array<int8_t, 3> status, Array<int32_t, 3> selected,
           Array<double, 2> mass, Array<double, 2> rerouted, Array<int32_t, 2> prefetched,
           Array<int32_t, 2> requested, Array<int32_t, 2> admitted) {
          const int64_t T = logits.shape(0), L = logits.shape(1), E = logits.shape(2);
          const PolicyParams p = make_policy(policy);
          if (static_cast<int64_t>(capacities.size()) != L ||
              static_cast<int64_t>(pins.size()) != L ||
              static_cast<int64_t>(initials.size()) != L)
            throw std::invalid_argument("scan: need one capacity, pin and initial set per layer");
          const float* y = lookahead ? lookahead->data() : nullptr;
          const double* A = coactivation ? coactivation->data() : nullptr;
          nb::gil_scoped_release release;
          std::vector<Future> futures;
          if (p.eviction == Eviction::Belady)
            for (int64_t l = 0; l < L; ++l) {
              try {
                futures.push_back(layer_future(logits.data() + l * E, T, L * E,
                                               static_cast<int>(E), k));
              } catch (const NonFiniteLogits& ex) {
                throw non_finite("logits", ex.token, l, logits.data() + (ex.token * L + l) * E);
              }
            }
          std::vector<LayerCache> caches;
          std::vector<StepOut> outs;
          for (int64_t l = 0; l < L; ++l) {
            if (static_cast<int64_t>(initials[l].shape(0)) != capacities[l])
              throw std::invalid_argument("scan: an initial set's length is not its capacity");
            PolicyParams pl = p;
            pl.pin = pins[l];
            caches.emplace_back(static_cast<int>(E), k, capacities[l], pl, initials[l].data(),
                                false);
            if (A) caches.back().set_coactivation(A + l * E * E);
            if (!futures.empty()) caches.back().set_future(&futures[l]);
            StepOut out;
            out.ids = ids.data() + l * k;
            out.weights = weights.data() + l * k;
            out.status = status.data() + l * k;
            out.selected = selected.data() + l * k;
            out.k_stride = L * k;
            out.mass = mass.data() + l;
            out.rerouted = rerouted.data() + l;
            out.prefetched = prefetched.data() + l;
            out.requested = requested.data() + l;
            out.admitted = admitted.data() + l;
            out.mass_stride = L;
            outs.push_back(out);
          }
          // the lookahead's top-n of every layer is read beside the logits' top-k
          const int n = y && p.prefetch > 0 ? p.prefetch : 0;
          std::vector<int32_t> sel(L * k), pref(L * std::max(n, 1));
          std::vector<float> vals(L * k), pref_vals(std::max(n, 1));
          std::vector<double> w(L * k);
          // route_bias: each row's smallest logit, from the top-k's pass over the row
          std::vector<float> zmin(L, 0.0f);
          for (int64_t t = 0; t < T; ++t) {
            const float* rows = logits.data() + t * L * E;
            for (int64_t l = 0; l < L; ++l) {
              if (!select_topk(rows + l * E, static_cast<int>(E), k, &sel[l * k], &vals[l * k],
                               p.route_bias > 0.0 ? &zmin[l] : nullptr))
                throw non_finite("logits", t, l, rows + l * E);
              const float* yl = n ? y + (t * L + l) * E : nullptr;
              if (n && !select_topk(yl, static_cast<int>(E), n, &pref[l * n], pref_vals.data()))
                throw non_finite("lookahead", t, l, yl);
            }
            gate_weights(vals.data(), L, k, w.data());
            for (int64_t l = 0; l < L; ++l)
              caches[l].step_selected(rows + l * E, &sel[l * k], &w[l * k], outs[l], t,
                                      n ? &pref[l * n] : nullptr, zmin[l]);
          }
        });

  // Co-activation counts (L, E, E) int64 of a (T, L, E) trace, added to `counts`.
  m.def("coactivation_counts", [](Array<const float, 3> logits, int k, Array<int64_t, 3> counts) {
    const int64_t T = logits.shape(0), L = logits.shape(1), E = logits.shape(2);
    nb::gil_scoped_release release;
    for (int64_t l = 0; l < L; ++l) {
      try {
        coactivation_counts(logits.data() + l * E, T, L * E, static_cast<int>(E), k,
                            counts.data() + l * E * E);
      } catch (const NonFiniteLogits& ex) {
        throw non_finite("logits", ex.token, l, logits.data() + (ex.token * L + l) * E);
      }
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

  // Grid simulation. Per grid point g: its policy (Policy._core_args()), per layer its capacity,
  // pin and initial set, its belady flag and optional token-layer counts (sum of T, L, F) int16;
  // per stream an optional lookahead array; one optional (L, E, E) co-activation table. Fills
  // counters (G, L, 10) int64 in Counters order (rerouted apart), rerouted (G, L) float64 sums,
  // belady hits (G, L), mass[g] and counts[g].
  m.def("simulate_grid",
        [](std::vector<Array<const float, 3>> streams,
           std::vector<std::optional<Array<const float, 3>>> lookahead, int k,
           std::vector<PolicyArgs> policies, std::vector<std::vector<int>> capacities,
           std::vector<std::vector<int>> pins,
           std::vector<std::vector<Array<const int32_t, 1>>> initials, std::vector<bool> belady,
           std::optional<Array<const double, 3>> coactivation, std::vector<Array<double, 2>> mass,
           std::vector<std::optional<Array<int16_t, 3>>> token_counts,
           Array<int64_t, 3> counters_out, Array<double, 2> rerouted_out,
           Array<int64_t, 2> belady_out, int n_threads) {
          const int L = static_cast<int>(streams.at(0).shape(1));
          const int E = static_cast<int>(streams.at(0).shape(2));
          std::vector<StreamView> views;
          int64_t total_T = 0;
          for (size_t i = 0; i < streams.size(); ++i) {
            views.push_back({streams[i].data(), static_cast<int64_t>(streams[i].shape(0)),
                             lookahead.at(i) ? lookahead[i]->data() : nullptr});
            total_T += views.back().T;
          }
          std::vector<GridPoint> points(policies.size());
          std::vector<double*> mass_ptrs;
          for (size_t g = 0; g < policies.size(); ++g) {
            points[g].policy = make_policy(policies[g]);
            points[g].capacity = capacities.at(g);
            points[g].pin = pins.at(g);
            for (const auto& init : initials.at(g)) points[g].initial.push_back(init.data());
            if (static_cast<int>(points[g].capacity.size()) != L ||
                static_cast<int>(points[g].pin.size()) != L ||
                static_cast<int>(points[g].initial.size()) != L)
              throw std::invalid_argument(
                  "simulate_grid: need one capacity, pin and initial set per layer");
            for (int l = 0; l < L; ++l)
              if (static_cast<int>(initials[g][l].shape(0)) != points[g].capacity[l])
                throw std::invalid_argument(
                    "simulate_grid: an initial set's length is not its capacity");
            points[g].belady = belady[g];
            points[g].counts = token_counts.at(g) ? token_counts[g]->data() : nullptr;
            if (points[g].counts &&
                (static_cast<int64_t>(token_counts[g]->shape(0)) != total_T ||
                 static_cast<int>(token_counts[g]->shape(1)) != L ||
                 static_cast<int>(token_counts[g]->shape(2)) != kTokenLayerFields))
              throw std::invalid_argument("simulate_grid: token counts need shape (sum of T, L, F)");
            mass_ptrs.push_back(mass[g].data());
          }
          std::vector<Counters> counters(points.size() * L);
          {
            nb::gil_scoped_release release;
            simulate_grid(views, L, E, k, points, n_threads, counters.data(), mass_ptrs,
                          belady_out.data(), coactivation ? coactivation->data() : nullptr);
          }
          int64_t* c = counters_out.data();
          for (size_t j = 0; j < counters.size(); ++j) {
            const Counters& x = counters[j];
            const int64_t row[10] = {x.tokens,     x.hit,        x.fetch,
                                     x.sub,        x.host,       x.forced,
                                     x.admission_requests, x.admissions, x.evictions,
                                     x.prefetches};
            std::copy(row, row + 10, c);
            c += 10;
            rerouted_out.data()[j] = x.rerouted;
          }
        });
  // ---- overlap-aware pricing (moesub.pricing.price_stream): counts int32 or int64
  using CostArgs =
      std::tuple<double, double, double, double, double, double, bool, bool, double, double,
                 double, double, double, double>;
  auto bind_price = [&m](auto tag) {
    using Int = decltype(tag);
    m.def("price_stream", [](Array<const Int, 3> counts, int64_t delay, CostArgs c,
                             Array<double, 1> token_s, Array<double, 1> parts) {
      if (counts.shape(2) != kFields || parts.shape(0) != kParts ||
          token_s.shape(0) != counts.shape(0) || delay < 1)
        throw std::invalid_argument("price_stream: bad shapes or delay");
      const UnitCosts u{std::get<0>(c), std::get<1>(c), std::get<2>(c), std::get<3>(c),
                        std::get<4>(c), std::get<5>(c), std::get<6>(c),
                        std::get<7>(c), std::get<8>(c), std::get<9>(c),
                        std::get<10>(c), std::get<11>(c), std::get<12>(c),
                        std::get<13>(c)};
      nb::gil_scoped_release release;
      price_stream<Int>(counts.data(), static_cast<int64_t>(counts.shape(0)),
                        static_cast<int64_t>(counts.shape(1)), delay, u, token_s.data(),
                        parts.data());
    });
  };
  bind_price(int32_t{});
  bind_price(int64_t{});
}
