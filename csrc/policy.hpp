// The one policy core of moesub: per-layer expert cache, miss rules, substitution, eviction and
// background admission, exactly as docs/policy-semantics.md specifies. Simulate, emulate and
// the engine all drive this class; `moesub.policy.reference_scan` is its plain-Python twin.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace moesub {

enum class Rule : int {
  FetchAll = 0,
  SubstituteAll = 1,
  FirstChoice = 2,
  Threshold = 3,
  HostCompute = 4
};
enum class Eviction : int { Lru = 0, Lfu = 1, Belady = 2 };  // belady: offline (needs the future)
enum class LightMiss : int { Substitute = 0, Host = 1 };
enum class SubstituteBy : int { Logit = 0, Coactivation = 1 };
constexpr int kMaxTopK = 64;
enum Status : int8_t { HIT = 0, FETCH = 1, SUB = 2, HOST = 3, FORCED = 4 };

struct PolicyParams {
  Rule rule = Rule::FetchAll;
  double tau = 0.15;
  Eviction eviction = Eviction::Lru;
  double beta = 0.0;  // 0 = no background admission
  int64_t delay = 1;
  // v2 (docs/policy-semantics.md); the defaults are v1
  int prefetch = 0;          // experts prefetched per token from the lookahead logits (step 1b)
  double route_bias = 0.0;   // lambda of cache-aware routing (step 2)
  LightMiss light_miss = LightMiss::Substitute;
  SubstituteBy substitute_by = SubstituteBy::Logit;
  // v3; the defaults are v2
  int pin = 0;         // the first `pin` slots (the initial set's first experts) are never victims
  int host_admit = 0;  // HOST experts enqueued for background admission per token (after step 5)
};

// Per-layer counters, summed over every token the layer has processed.
struct Counters {
  int64_t tokens = 0, hit = 0, fetch = 0, sub = 0, host = 0, forced = 0;
  int64_t admission_requests = 0, admissions = 0, evictions = 0;
  int64_t prefetches = 0;  // experts inserted in step 1b
  double rerouted = 0.0;   // rerouted mass, summed over tokens
};

// What one token-layer did, as counts (moesub.vocabulary.TOKEN_LAYER_FIELDS, in this order).
enum TokenLayerField : int {
  kCountHit, kCountFetch, kCountSub, kCountHost, kCountForced,  // experts per status
  kCountPrefetched,         // experts inserted in step 1b
  kCountRequests,           // admission requests (beta admissions, host uploads)
  kCountAdmissions,         // admissions landed (inserted) in step 1
  kTokenLayerFields
};
static_assert(kCountHit == HIT && kCountForced == FORCED, "status counts come first, by code");

// Where one step's per-token outputs go. Strides are in elements between consecutive tokens, so
// a (T, L, k) array can be filled one layer at a time. Any pointer may be null (not wanted).
struct StepOut {
  int32_t* ids = nullptr;       // computed expert per rank
  double* weights = nullptr;    // normalized gate weight of the originally selected expert
  int8_t* status = nullptr;
  int32_t* selected = nullptr;  // selected expert per rank (route_bias: the biased selection S)
  int32_t* slot = nullptr;      // cache slot of the computed expert (-1 for HOST)
  int64_t k_stride = 0;         // between tokens in ids/weights/status/selected/slot
  double* mass = nullptr;       // substituted mass per token
  int64_t mass_stride = 1;      // between tokens in mass/rerouted/prefetched
  double* rerouted = nullptr;   // rerouted mass per token (route_bias)
  int32_t* prefetched = nullptr;  // experts inserted in step 1b per token
  std::vector<std::pair<int64_t, int32_t>>* admissions = nullptr;  // (token, expert) enqueued
  int32_t* requested = nullptr;   // admission requests per token (mass_stride apart)
  int32_t* admitted = nullptr;    // admissions landed in step 1 per token (mass_stride apart)
  int16_t* counts = nullptr;      // kTokenLayerFields per token, counts_stride apart
  int64_t counts_stride = 0;
};

// A logit row held NaN or inf; `token` is the row's index within the call.
struct NonFiniteLogits : std::invalid_argument {
  explicit NonFiniteLogits(int64_t t)
      : std::invalid_argument("logits: contain NaN or inf (token " + std::to_string(t) + ")"),
        token(t) {}
  int64_t token;
};

// The lookahead logits held NaN or inf at `token` (the row's index within the call).
struct NonFiniteLookahead : std::invalid_argument {
  explicit NonFiniteLookahead(int64_t t)
      : std::invalid_argument("lookahead: contain NaN or inf (token " + std::to_string(t) + ")"),
        token(t) {}
  int64_t token;
};

// Top-k of one logit row: ranked by logit descending, ties to the lower id. Returns false (and
// leaves the outputs undefined) if the row holds NaN or inf. With `min_out`, also the row's
// smallest logit (route_bias's range), from the same pass over the row.
bool select_topk(const float* z, int E, int k, int32_t* ids_out, float* vals_out,
                 float* min_out = nullptr);

// Normalized gate weights (float64) of `rows` rows of k selected logits in rank order, (rows, k):
// softmax over the row, with the core's own exp (within 1 ulp of std::exp, the same bits on
// every machine). Batching rows is faster; each row's result does not depend on the batch.
void gate_weights(const float* vals, int64_t rows, int k, double* w_out);

// What Belady's eviction knows of one layer's stream: every token's top-k (`sel`, (T, k)), for
// token t and rank r the next token after t that selects the same expert (`next_after`, (T, k)),
// and each expert's first selection (`first_use`, E); kNever if none.
struct Future {
  static constexpr int32_t kNever = std::numeric_limits<int32_t>::max();
  int k = 0;
  std::vector<int32_t> sel, next_after, first_use;
};
Future layer_future(const float* logits, int64_t T, int64_t row_stride, int E, int k);

// Co-activation counts of one layer: counts[a * E + b] += 1 for every ordered pair (a, b) of a
// token's top-k (a == b included: the diagonal counts each expert's selections).
void coactivation_counts(const float* logits, int64_t T, int64_t row_stride, int E, int k,
                         int64_t* counts);

// Experiment B: substitute exactly the ranks in `sub_mask` (T, k) from a static resident set;
// every other selected expert is computed exactly. Candidates exclude all selected experts.
// Outputs are (T, k).
void forced_substitution(const float* logits, int64_t T, int E, int k, const int32_t* resident,
                         int C, const uint8_t* sub_mask, int32_t* ids, double* weights,
                         int32_t* selected);

class LayerCache {
 public:
  LayerCache(int num_experts, int k, int capacity, PolicyParams policy, const int32_t* initial,
             bool external_admission);

  // Process `T` consecutive tokens; `logits` rows are `row_stride` floats apart. Throws
  // NonFiniteLogits at a NaN/inf row, after the rows before it were processed.
  // With prefetch > 0 `lookahead` holds the lookahead rows, `lookahead_stride` floats apart
  // (NonFiniteLookahead at a NaN/inf row).
  void step(const float* logits, int64_t T, int64_t row_stride, const StepOut& out,
            const float* lookahead = nullptr, int64_t lookahead_stride = 0);

  // One token whose selection is already known: `sel` holds the top-k experts by rank and `w`
  // their normalized gate weights (select_topk + gate_weights of `z`); outputs go to token `i`
  // of `out`. Selection does not depend on the cache, so callers replaying many layers or
  // policies over one trace select once.
  // With prefetch > 0, `pref` holds the lookahead row's top-n by rank (select_topk, n >= the
  // policy's prefetch; a longer list's prefix is the shorter one). With route_bias > 0, `sel`
  // and `w` are the unbiased top-k T0 and the cache re-selects from them; `zmin` is the row's
  // smallest logit (select_topk's min_out), unused without route_bias.
  void step_selected(const float* z, const int32_t* sel, const double* w, const StepOut& out,
                     int64_t i, const int32_t* pref = nullptr,
                     float zmin = std::numeric_limits<float>::quiet_NaN());

  // substitute_by = coactivation: this layer's co-activation table A (E, E), row-major; it must
  // outlive the cache.
  void set_coactivation(const double* A) { coact_ = A; }
  // eviction = belady: the whole stream's future of this layer (it must outlive the cache and
  // cover every token stepped).
  void set_future(const Future* future);

  // External-admission mode: the copy of `expert` completed; make it resident now.
  // Returns (slot, evicted expert or -1); slot is the existing one if it was already resident.
  std::pair<int32_t, int32_t> admit(int32_t expert);

  int64_t t() const { return t_; }
  const std::vector<int32_t>& resident() const { return expert_in_slot_; }
  const Counters& counters() const { return counters_; }
  bool pending(int32_t expert) const { return expert_[expert].pending; }

 private:
  // Eviction keys are kept per slot, so choosing a victim is a branch-free pass over C keys:
  // 32-bit where the eviction's keys fit (lru, belady: half the bytes per pass), 64-bit for lfu.
  // A resident in the current token's computed set is pinned: its key is the type's largest
  // value until step 6. The policy's permanently pinned experts hold slots 0..pin-1 for the
  // whole stream (they start there and are never evicted), so victims are sought in the slots
  // from `pin` on: their keys are never read.
  static constexpr int64_t kMaxTokens = (int64_t{1} << 31) - 2;  // freq, last use + 1 < 2^31
  int64_t eviction_key(int32_t expert) const;
  void set_key(int32_t slot, int64_t key) {
    if (wide_keys_)
      key64_[slot] = key;
    else
      key32_[slot] = static_cast<int32_t>(key);
  }
  void pin(int32_t slot) {
    if (wide_keys_)
      key64_[slot] = std::numeric_limits<int64_t>::max();
    else
      key32_[slot] = std::numeric_limits<int32_t>::max();
  }
  int32_t prefetch(const int32_t* P);  // step 1b: experts inserted
  // step 2 with route_bias: S and its weights (k each) from the unbiased top-k T0 (sel0, w0)
  // and the bias b; returns the rerouted mass
  double biased_selection(const float* z, const int32_t* sel0, const double* w0, double b,
                          int32_t* sel, double* w);
  int32_t pick_victim() const;  // unpinned resident with the smallest key, -1 if all are pinned
  std::pair<int32_t, int32_t> insert(int32_t e);  // evicts the victim: (freed slot, victim)
  int32_t apply_ready_admissions();  // step 1: experts inserted
  void request_admission(int32_t e, const StepOut& out);  // enqueue e (the caller checked)

  int E_, k_, C_;
  PolicyParams p_;
  bool external_;
  int64_t t_ = 0;
  struct Expert {  // per-expert state, together: a token touches it for each selected expert
    int32_t slot = -1;   // cache slot, -1 if not resident
    int32_t freq = 0;    // times selected (lfu)
    int32_t last = -1;   // last token it was computed at
    bool pending = false;  // an admission is queued
  };
  std::vector<Expert> expert_;           // E
  std::vector<int32_t> expert_in_slot_;  // C: expert or -1
  bool wide_keys_;                       // lfu
  std::vector<int64_t> key64_;           // C (lfu): eviction key of the slot's expert, or pinned
  std::vector<int32_t> key32_;           // C (lru, belady)
  std::vector<double> acc_;
  std::deque<std::pair<int64_t, int32_t>> queue_;  // (ready time, expert), in request order
  Counters counters_;
  // scratch
  std::vector<int32_t> sel_;
  std::vector<double> w_;
  std::vector<float> zs_;  // best_substitute's scratch
  // v2
  const double* coact_ = nullptr;   // (E, E) co-activation table of this layer
  const Future* future_ = nullptr;  // belady only
  std::vector<int32_t> upcoming_;   // belady: each expert's next selection at or after now
  std::vector<int32_t> pref_ids_;   // step(): the lookahead's top-n (prefetch)
  std::vector<float> pref_vals_;
  // route_bias: residency as a bitmap (E bits: one cache line for 512 experts, where expert_
  // would take a miss per probe); scratch bitmaps: T0, and the row's experts whose logit could
  // carry them into S if they were resident
  std::vector<uint64_t> res_bits_, t0_bits_, cand_bits_;
  bool is_resident(int32_t e) const { return res_bits_[e >> 6] >> (e & 63) & 1; }
};

// Belady's optimal eviction for fetch-every-miss over one layer of a token stream: evict the
// resident (not needed by the current token) whose next use is farthest in the future.
// Returns the number of hits.
int64_t belady_hits(const float* logits, int64_t T, int64_t row_stride, int E, int k, int C,
                    const int32_t* initial);

}  // namespace moesub
