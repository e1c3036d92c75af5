#include "policy.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

// The hot loops (top-k filter, exp, substitute and victim choice) use short vectors and are
// compiled twice on x86-64 Linux, for AVX2 and for the baseline, one picked at load time. Both
// clones run the same IEEE operations in the same order (and the build turns off FMA
// contraction), so every machine computes the same bits.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define MOESUB_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOESUB_SIMD_CLONES
#endif

namespace moesub {

// Short vectors: GCC/Clang vector extensions, lowered to AVX2 or SSE on x86 and NEON on Arm.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

template <class V, class T>
static inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V, class T>
static inline V broadcast(T x) {
  return V{} + x;
}
template <class M, class V>
static inline V select(M mask, V a, V b) {
  return mask ? a : b;
}

// The lowest id among the n entries whose value equals `best`, without branches: V holds values,
// I the int32 ids of the same lanes.
template <class V, class I, class T>
static inline int32_t lowest_id_where(const T* value, T best, const int32_t* id, int n) {
  constexpr int W = sizeof(V) / sizeof(T);
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  const int full = n / W * W;
  I lowest = broadcast<I>(kNone);
  for (int s = 0; s < full; s += W) {
    const I holds = __builtin_convertvector(load<V>(value + s) == best, I);
    const I e = select(holds, load<I>(id + s), broadcast<I>(kNone));
    lowest = select(e < lowest, e, lowest);
  }
  int32_t out = kNone;
  for (int i = 0; i < W; ++i) out = lowest[i] < out ? lowest[i] : out;
  for (int s = full; s < n; ++s) out = (value[s] == best && id[s] < out) ? id[s] : out;
  return out;
}

// Insert (v, e) into a sorted top-k list of n entries; a later expert displaces an earlier one
// only if its logit is strictly larger, so equal logits keep the lower id first.
static inline void topk_insert(float v, int32_t e, int k, int& n, int32_t* ids, float* vals) {
  if (n == k && !(v > vals[k - 1])) return;
  int pos = n < k ? n++ : k - 1;
  while (pos > 0 && v > vals[pos - 1]) {
    vals[pos] = vals[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  vals[pos] = v;
  ids[pos] = e;
}

// Reference path: plain insertion over every expert.
static bool topk_by_insertion(const float* z, int E, int k, int32_t* ids, float* vals,
                              float* min_out) {
  int n = 0;
  float lowest = std::numeric_limits<float>::infinity();
  for (int e = 0; e < E; ++e) {
    if (!std::isfinite(z[e])) return false;
    topk_insert(z[e], e, k, n, ids, vals);
    lowest = z[e] < lowest ? z[e] : lowest;
  }
  if (min_out) *min_out = lowest;
  return true;
}

// Fast path. Lane i of `Lanes` holds experts i, i + Lanes, i + 2 Lanes, ...; the k-th largest
// lane maximum `thr` is reached by at least k logits, so it bounds the k-th largest logit from
// below, and candidates are the logits >= thr. One pass keeps each lane's maximum, its expert and
// the runner-up, so a top lane is rescanned only if its runner-up also reaches thr. Stages avoid
// data-dependent branches: candidates sit at random positions, and mispredictions cost more than
// the work. 32 lanes for k > 4; 16 for smaller k (prefetch's top-n), where the k-th lane maximum
// is found in a quarter of the comparisons.
constexpr int kMaxFastE = 4096, kRankWidth = 16;

// Sorts n <= W candidates by (logit descending, id ascending) into ranked_ids/vals: each one's
// rank is the number of candidates ahead of it, so all are placed without branches. One signed
// 64-bit key per candidate orders both: the logit's bits made monotone (-0 as +0, so that equal
// logits tie), then the id reversed. Padding keys sort after every candidate.
template <int W>
static inline void rank_candidates(const int32_t* cand, const float* cval, int n,
                                   int32_t* ranked_ids, float* ranked_vals) {
  int64_t key[W];
  for (int a = 0; a < W; ++a) key[a] = std::numeric_limits<int64_t>::min() + (W - a);
  for (int a = 0; a < n; ++a) {
    int32_t bits;
    const float v = cval[a] + 0.0f;
    std::memcpy(&bits, &v, sizeof bits);
    key[a] = (static_cast<int64_t>(bits ^ ((bits >> 31) & 0x7fffffff)) << 32) |
             (0x7fffffff - cand[a]);
  }
  i64x4 rank[W / 4] = {};
  for (int b = 0; b < W; ++b)
    for (int v = 0; v < W / 4; ++v) rank[v] -= key[b] > load<i64x4>(key + 4 * v);
  for (int a = 0; a < n; ++a) {
    ranked_ids[rank[a / 4][a % 4]] = cand[a];
    ranked_vals[rank[a / 4][a % 4]] = cval[a];
  }
}

template <int Lanes, bool kMin>
MOESUB_SIMD_CLONES static bool topk_by_lanes(const float* z, int E, int k, int32_t* ids,
                                             float* vals, float* min_out) {
  constexpr int kVecs = Lanes / 8;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // 1. per lane: maximum, its expert, runner-up; and whether any logit is NaN or inf (then
  // x - x is NaN, else +0: its bits ORed into one accumulator, so that the loop's state fits in
  // registers)
  f32x8 m[kVecs], m2[kVecs], lowest[kVecs];  // lowest: only with kMin
  i32x8 arg[kVecs], lane[kVecs], non_finite = {};
  for (int v = 0; v < kVecs; ++v) {
    for (int i = 0; i < 8; ++i) lane[v][i] = 8 * v + i;
    m[v] = load<f32x8>(z + 8 * v);
    lowest[v] = m[v];
    m2[v] = broadcast<f32x8>(-kInf);
    arg[v] = lane[v];
    non_finite |= reinterpret_cast<i32x8>(m[v] - m[v]);
  }
  const int full = E / Lanes * Lanes;
  constexpr int kStep = kVecs < 2 ? kVecs : 2;  // vectors per pass: the state fits registers
  for (int half = 0; half < kVecs; half += kStep)
    for (int j = Lanes; j < full; j += Lanes)
      for (int v = half; v < half + kStep; ++v) {
        const f32x8 x = load<f32x8>(z + j + 8 * v);
        const i32x8 gt = x > m[v];
        m2[v] = select(gt, m[v], select(x > m2[v], x, m2[v]));
        arg[v] = select(gt, lane[v] + j, arg[v]);
        m[v] = select(gt, x, m[v]);
        if (kMin) lowest[v] = select(x < lowest[v], x, lowest[v]);
        non_finite |= reinterpret_cast<i32x8>(x - x);
      }
  float lane_m[Lanes], lane_m2[Lanes];
  int32_t lane_arg[Lanes];
  float row_min = std::numeric_limits<float>::infinity();
  if (kMin) {
    for (int v = 1; v < kVecs; ++v) lowest[0] = select(lowest[v] < lowest[0], lowest[v], lowest[0]);
    for (int i = 0; i < 8; ++i) row_min = lowest[0][i] < row_min ? lowest[0][i] : row_min;
  }
  for (int v = 0; v < kVecs; ++v) {
    std::memcpy(lane_m + 8 * v, &m[v], sizeof m[v]);
    std::memcpy(lane_m2 + 8 * v, &m2[v], sizeof m2[v]);
    std::memcpy(lane_arg + 8 * v, &arg[v], sizeof arg[v]);
  }
  bool finite = true;
  for (int i = 0; i < 8; ++i) finite &= non_finite[i] == 0;
  for (int e = full; e < E; ++e) {  // ragged tail
    const int i = e - full;
    const float x = z[e];
    finite &= std::isfinite(x);
    lane_m2[i] = x > lane_m[i] ? lane_m[i] : (x > lane_m2[i] ? x : lane_m2[i]);
    lane_arg[i] = x > lane_m[i] ? e : lane_arg[i];
    lane_m[i] = x > lane_m[i] ? x : lane_m[i];
    row_min = x < row_min ? x : row_min;
  }
  if (!finite) return false;
  if (kMin) *min_out = row_min;
  for (int v = 0; v < kVecs; ++v) m[v] = load<f32x8>(lane_m + 8 * v);  // with the tail
  // 2. top lanes: fewer than k lane maxima strictly above; thr = the smallest of their maxima
  i32x8 above[kVecs] = {};
  for (int i = 0; i < Lanes; ++i) {
    const f32x8 mi = broadcast<f32x8>(lane_m[i]);
    for (int v = 0; v < kVecs; ++v) above[v] -= mi > m[v];  // a true mask is -1
  }
  f32x8 top_m = broadcast<f32x8>(kInf);
  for (int v = 0; v < kVecs; ++v) {
    const f32x8 mv = select(above[v] < broadcast<i32x8>(k), m[v], broadcast<f32x8>(kInf));
    top_m = select(mv < top_m, mv, top_m);
  }
  float thr = kInf;
  for (int i = 0; i < 8; ++i) thr = top_m[i] < thr ? top_m[i] : thr;
  // 3. candidates: each top lane's maximum, plus its other logits >= thr if its runner-up
  // reaches thr (a rescan of that lane: one or two lanes of a top-10 row, measured)
  int32_t cand[kMaxFastE];
  float cval[kMaxFastE];
  uint32_t top = 0, rescan = 0;
  for (int i = 0; i < Lanes; ++i) {
    top |= static_cast<uint32_t>(lane_m[i] >= thr) << i;
    rescan |= static_cast<uint32_t>(lane_m2[i] >= thr) << i;
  }
  int nc = 0;
  for (; top; top &= top - 1, ++nc) {  // about k lanes
    const int i = __builtin_ctz(top);
    cand[nc] = lane_arg[i];
    cval[nc] = lane_m[i];
  }
  for (; rescan; rescan &= rescan - 1) {
    const int i = __builtin_ctz(rescan);
    for (int e = i; e < E; e += Lanes) {
      cand[nc] = e;
      cval[nc] = z[e];
      nc += (z[e] >= thr) & (e != lane_arg[i]);
    }
  }
  // 4. rank the candidates; more than 16 (exact ties) go through insertion instead
  if (nc > kRankWidth) {
    for (int a = 1; a < nc; ++a)  // restore id order for insertion's tie rule
      for (int b = a; b > 0 && cand[b] < cand[b - 1]; --b) {
        std::swap(cand[b], cand[b - 1]);
        std::swap(cval[b], cval[b - 1]);
      }
    int n = 0;
    for (int a = 0; a < nc; ++a) topk_insert(cval[a], cand[a], k, n, ids, vals);
    return true;
  }
  int32_t ranked_ids[kRankWidth];
  float ranked_vals[kRankWidth];
  // Candidates are padded to 8, 12 (three quarters of top-10 rows) or 16.
  if (nc <= 8)
    rank_candidates<8>(cand, cval, nc, ranked_ids, ranked_vals);
  else if (nc <= 12)
    rank_candidates<12>(cand, cval, nc, ranked_ids, ranked_vals);
  else
    rank_candidates<16>(cand, cval, nc, ranked_ids, ranked_vals);
  std::copy(ranked_ids, ranked_ids + k, ids);
  std::copy(ranked_vals, ranked_vals + k, vals);
  return true;
}

bool select_topk(const float* z, int E, int k, int32_t* ids, float* vals, float* min_out) {
  if (E > kMaxFastE || E < 16 || k > 32 || (E < 32 && k > 4))
    return topk_by_insertion(z, E, k, ids, vals, min_out);
  if (k <= 4)
    return min_out ? topk_by_lanes<16, true>(z, E, k, ids, vals, min_out)
                   : topk_by_lanes<16, false>(z, E, k, ids, vals, nullptr);
  return min_out ? topk_by_lanes<32, true>(z, E, k, ids, vals, min_out)
                 : topk_by_lanes<32, false>(z, E, k, ids, vals, nullptr);
}

// e^x for x <= 0, four at a time, within 1 ulp of std::exp (subnormals included): x = n ln2 + r
// with |r| <= ln2 / 2, a degree-13 Taylor polynomial for e^r (truncation below 1e-17), and 2^n
// applied in two exact halves. Only adds and multiplies, and the build turns off FMA contraction,
// so every machine and clone computes the same bits. n is a multiple of 4. Many rows at once keep
// the polynomial's long dependency chains overlapped.
MOESUB_SIMD_CLONES
static void exp_nonpositive(const double* x, int64_t n, double* out) {
  constexpr double kInvLn2 = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // trailing zeros: n * kLn2Hi is exact
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  constexpr int64_t kShifterBits = 0x4338000000000000;  // its bit pattern
  constexpr double kInvFactorial[14] = {
      1.0,           1.0,            1.0 / 2,         1.0 / 6,         1.0 / 24,
      1.0 / 120,     1.0 / 720,      1.0 / 5040,      1.0 / 40320,     1.0 / 362880,
      1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800};
  for (int64_t i = 0; i < n; i += 4) {
    f64x4 v = load<f64x4>(x + i);
    v = select(v < -746.0, broadcast<f64x4>(-746.0), v);  // e^-746 rounds to 0
    const f64x4 t = v * kInvLn2 + kShifter;
    const f64x4 nd = t - kShifter;
    const i64x4 ni = reinterpret_cast<i64x4>(t) - kShifterBits;  // n, from the low bits
    const f64x4 r = (v - nd * kLn2Hi) - nd * kLn2Lo;
    f64x4 p = broadcast<f64x4>(kInvFactorial[13]);
    for (int d = 12; d >= 0; --d) p = p * r + kInvFactorial[d];
    const i64x4 n1 = ni >> 1, n2 = ni - n1;
    const f64x4 e = p * reinterpret_cast<f64x4>((n1 + 1023) << 52) *
                    reinterpret_cast<f64x4>((n2 + 1023) << 52);
    std::memcpy(out + i, &e, sizeof e);
  }
}

void gate_weights(const float* vals, int64_t rows, int k, double* w) {
  constexpr int64_t kRows = 16;  // per batch, on the stack
  double x[kRows * kMaxTopK], e[kRows * kMaxTopK];
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t n = std::min(kRows, rows - r0) * k;
    const float* v = vals + r0 * k;
    for (int64_t j = 0; j < n; j += k)  // logit minus the row's largest: exponents <= 0
      for (int r = 0; r < k; ++r) x[j + r] = static_cast<double>(v[j + r]) - v[j];
    for (int64_t j = n; j % 4; ++j) x[j] = 0.0;
    exp_nonpositive(x, (n + 3) / 4 * 4, e);
    for (int64_t j = 0; j < n; j += k) {
      double sum = 0.0;
      for (int r = 0; r < k; ++r) sum += e[j + r];
      for (int r = 0; r < k; ++r) w[r0 * k + j + r] = e[j + r] / sum;
    }
  }
}

// Gate weights of one row of k logits in any order (route_bias: S ranked by biased logits): the
// softmax of the logits against the row's largest, summed in the row's order. When the largest
// comes first this is gate_weights' arithmetic, bit for bit.
static void softmax_row(const float* v, int k, double* w) {
  float top = v[0];
  for (int r = 1; r < k; ++r) top = v[r] > top ? v[r] : top;
  double x[kMaxTopK + 4], e[kMaxTopK + 4];
  for (int r = 0; r < k; ++r) x[r] = static_cast<double>(v[r]) - top;
  for (int r = k; r % 4; ++r) x[r] = 0.0;
  exp_nonpositive(x, (k + 3) / 4 * 4, e);
  double sum = 0.0;
  for (int r = 0; r < k; ++r) sum += e[r];
  for (int r = 0; r < k; ++r) w[r] = e[r] / sum;
}

// Bitmap (E bits, into `bits`) of the experts e of a row with z[e] >= f: 32 logits at a time
// become a 32-bit mask (each lane's compare ANDed with its own bit, ORed across lanes).
MOESUB_SIMD_CLONES
static void mask_at_least(const float* z, int E, float f, uint64_t* bits) {
  i32x8 bit[4];
  for (int v = 0; v < 4; ++v)
    for (int j = 0; j < 8; ++j) bit[v][j] = static_cast<int32_t>(uint32_t{1} << (8 * v + j));
  std::fill(bits, bits + (E + 63) / 64, uint64_t{0});
  const int full = E / 32 * 32;
  for (int s = 0; s < full; s += 32) {
    i32x8 acc = {};
    for (int v = 0; v < 4; ++v) acc |= (load<f32x8>(z + s + 8 * v) >= f) & bit[v];
    const i64x4 a = reinterpret_cast<i64x4>(acc);
    const uint64_t q = static_cast<uint64_t>(a[0] | a[1] | a[2] | a[3]);
    const uint64_t mask = static_cast<uint32_t>(q) | static_cast<uint32_t>(q >> 32);
    bits[s >> 6] |= mask << (s & 63);
  }
  for (int e = full; e < E; ++e) bits[e >> 6] |= static_cast<uint64_t>(z[e] >= f) << (e & 63);
}

// A float f below thr - b by more than any rounding of z + b: z < f implies z + b < thr, so the
// experts with z >= f hold every one whose biased logit can reach thr.
static float outsider_floor(double thr, double b) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const double d = thr - b - (std::fabs(thr) + b) * 0x1p-50;
  float f = d < -std::numeric_limits<float>::max() ? -kInf : static_cast<float>(d);
  if (static_cast<double>(f) > d) f = std::nextafter(f, -kInf);
  return f;
}

// The largest float below a finite x: its bits one step toward -inf (std::nextafter is a call).
static inline float next_below(float x) {
  if (x == 0.0f) return -std::numeric_limits<float>::denorm_min();
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += x > 0.0f ? -1 : 1;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// Substitute choice of step 5 over prepared candidates: zs[s] is the logit of the expert in slot
// s, or kExcluded if it may not stand in (it is already in the token's computed set). Returns the
// expert with the highest logit, ties to the lower id; -1 if none. Callers fill zs once per token
// and exclude each pick, so a substitution costs two branch-free passes over C floats.
constexpr float kExcluded = -std::numeric_limits<float>::infinity();  // logits are finite

MOESUB_SIMD_CLONES
static int32_t best_substitute(const float* zs, const int32_t* resident, int C) {
  const int full = C / 8 * 8;
  f32x8 vmax = broadcast<f32x8>(kExcluded);
  for (int s = 0; s < full; s += 8) {
    const f32x8 x = load<f32x8>(zs + s);
    vmax = select(x > vmax, x, vmax);
  }
  float best_z = kExcluded;
  for (int i = 0; i < 8; ++i) best_z = vmax[i] > best_z ? vmax[i] : best_z;
  for (int s = full; s < C; ++s) best_z = zs[s] > best_z ? zs[s] : best_z;
  if (best_z == kExcluded) return -1;
  return lowest_id_where<f32x8, i32x8>(zs, best_z, resident, C);
}

// substitute_by = coactivation: among the candidates of best_substitute's `zs`, the expert c
// with the largest a[c] (the missed expert's co-activation row), ties to the higher logit, then
// the lower id; -1 if none.
static int32_t best_coactivated(const double* a, const float* zs, const int32_t* resident, int C) {
  int32_t best = -1;
  double best_a = 0.0;
  float best_z = kExcluded;
  for (int s = 0; s < C; ++s) {
    if (zs[s] == kExcluded) continue;
    const int32_t c = resident[s];
    if (best < 0 || a[c] > best_a ||
        (a[c] == best_a && (zs[s] > best_z || (zs[s] == best_z && c < best)))) {
      best = c;
      best_a = a[c];
      best_z = zs[s];
    }
  }
  return best;
}

void forced_substitution(const float* logits, int64_t T, int E, int k, const int32_t* resident,
                         int C, const uint8_t* sub_mask, int32_t* ids, double* weights,
                         int32_t* selected) {
  std::vector<int32_t> slot_of(E, -1);
  for (int s = 0; s < C; ++s) slot_of[resident[s]] = s;
  std::vector<float> vals(k), zs(C);
  for (int64_t t = 0; t < T; ++t) {
    const float* z = logits + t * E;
    int32_t* sel = selected + t * k;
    if (!select_topk(z, E, k, sel, vals.data())) throw NonFiniteLogits(t);
    gate_weights(vals.data(), 1, k, weights + t * k);
    // Every selected expert that is not substituted is computed exactly; a substituted one
    // cannot stand in for itself or for another selected expert either.
    for (int s = 0; s < C; ++s) zs[s] = z[resident[s]];
    for (int r = 0; r < k; ++r) {
      ids[t * k + r] = sel[r];
      if (slot_of[sel[r]] >= 0) zs[slot_of[sel[r]]] = kExcluded;
    }
    for (int r = 0; r < k; ++r) {
      if (!sub_mask[t * k + r]) continue;
      const int32_t s = best_substitute(zs.data(), resident, C);
      if (s < 0) throw std::invalid_argument("forced_substitution: no substitute candidate left");
      ids[t * k + r] = s;
      zs[slot_of[s]] = kExcluded;
    }
  }
}

LayerCache::LayerCache(int E, int k, int C, PolicyParams p, const int32_t* initial, bool external)
    : E_(E), k_(k), C_(C), p_(p), external_(external), expert_(E), expert_in_slot_(C, -1),
      wide_keys_(p.eviction == Eviction::Lfu), key64_(wide_keys_ ? C : 0),
      key32_(wide_keys_ ? 0 : C), acc_(E, 0.0), sel_(k), w_(k), zs_(C),
      pref_ids_(std::max(p.prefetch, 1)), pref_vals_(std::max(p.prefetch, 1)),
      res_bits_((E + 63) / 64, 0), t0_bits_((E + 63) / 64, 0), cand_bits_((E + 63) / 64, 0) {
  if (k < 1 || k > kMaxTopK || C < k || C > E)
    throw std::invalid_argument("need 1 <= k <= capacity <= num_experts and k <= 64");
  if (p.prefetch < 0 || p.prefetch > C)
    throw std::invalid_argument("policy prefetch: must be in [0, capacity=" + std::to_string(C) +
                                "], got " + std::to_string(p.prefetch));
  if (!(std::isfinite(p.route_bias) && p.route_bias >= 0.0))
    throw std::invalid_argument("policy route_bias: must be a finite number >= 0");
  if (p.eviction == Eviction::Belady && p.route_bias > 0.0)
    throw std::invalid_argument(
        "policy eviction 'belady' with route_bias > 0: the future selection depends on the cache");
  if (p.pin < 0 || p.pin + std::max(k, p.prefetch) > C)
    throw std::invalid_argument("policy pin: need 0 <= pin and pin + max(k, prefetch) <= capacity");
  if (p.host_admit < 0 ||
      (p.host_admit > 0 && p.rule != Rule::HostCompute && p.light_miss != LightMiss::Host))
    throw std::invalid_argument(
        "policy host_admit: must be >= 0, and > 0 only where misses are computed on the host");
  if (p.eviction == Eviction::Belady) upcoming_.assign(E, Future::kNever);
  for (int s = 0; s < C; ++s) {
    const int32_t e = initial ? initial[s] : s;
    if (e < 0 || e >= E || expert_[e].slot != -1)
      throw std::invalid_argument("initial resident set must hold distinct experts in [0, E)");
    expert_[e].slot = s;
    expert_in_slot_[s] = e;
    set_key(s, eviction_key(e));
    res_bits_[e >> 6] |= uint64_t{1} << (e & 63);
  }
}

// Eviction order (smallest first): lfu (freq, last use, id); lru (last use, id); belady (next
// selection, farthest first, id). The key packs all but the id (last use + 1, so never-used
// experts with last = -1 come first; belady: kNever - 1 minus the next selection, so never again
// is -1 and every key stays below the pinned one); ties on the key go to the lower id in
// pick_victim.
int64_t LayerCache::eviction_key(int32_t e) const {
  if (p_.eviction == Eviction::Belady) return int64_t{Future::kNever} - 1 - upcoming_[e];
  const int64_t recency = expert_[e].last + 1;
  if (p_.eviction == Eviction::Lfu) return (static_cast<int64_t>(expert_[e].freq) << 32) | recency;
  return recency;
}

// The slot with the smallest key, as its expert (ties to the lower id); -1 if every key is the
// pinned one, the type's largest. V holds W keys of type K.
template <class V, class K>
MOESUB_SIMD_CLONES static int32_t smallest_key(const K* key, const int32_t* expert, int C) {
  // The smallest key (a branch-free pass), then the lowest id among the slots holding it.
  constexpr int W = sizeof(V) / sizeof(K);
  constexpr K kPinned = std::numeric_limits<K>::max();
  const int full = C / W * W;
  V vmin = broadcast<V>(kPinned);
  for (int s = 0; s < full; s += W) {
    const V x = load<V>(key + s);
    vmin = select(x < vmin, x, vmin);
  }
  K best_key = kPinned;
  for (int i = 0; i < W; ++i) best_key = vmin[i] < best_key ? vmin[i] : best_key;
  for (int s = full; s < C; ++s) best_key = key[s] < best_key ? key[s] : best_key;
  if (best_key == kPinned) return -1;
  if constexpr (W == 8) return lowest_id_where<V, V>(key, best_key, expert, C);
  // 64-bit keys: narrowing a compare's mask to int32 lanes costs more than the compare, so the
  // slots holding the key (few: lfu ties) are gathered as a bitmap, 64 at a time, and walked
  int32_t lowest = std::numeric_limits<int32_t>::max();
  for (int s0 = 0; s0 < C; s0 += 64) {
    const int end = std::min(C, s0 + 64), end4 = s0 + (end - s0) / 4 * 4;
    i64x4 bits = {}, bit = {1, 2, 4, 8};  // lane i of the j-th four keys: bit 4 j + i
    for (int s = s0; s < end4; s += 4, bit <<= 4) bits |= (load<i64x4>(key + s) == best_key) & bit;
    uint64_t holds = static_cast<uint64_t>(bits[0] | bits[1] | bits[2] | bits[3]);
    for (int s = end4; s < end; ++s) holds |= static_cast<uint64_t>(key[s] == best_key) << (s - s0);
    for (; holds; holds &= holds - 1) {
      const int32_t e = expert[s0 + __builtin_ctzll(holds)];
      lowest = e < lowest ? e : lowest;
    }
  }
  return lowest;
}

int32_t LayerCache::pick_victim() const {
  const int P = p_.pin;  // slots 0..pin-1 hold the pinned experts: never victims
  const int32_t* expert = expert_in_slot_.data() + P;
  return wide_keys_ ? smallest_key<i64x4>(key64_.data() + P, expert, C_ - P)
                    : smallest_key<i32x8>(key32_.data() + P, expert, C_ - P);
}

std::pair<int32_t, int32_t> LayerCache::insert(int32_t e) {
  // The cache is always full (it starts from C residents), so every insertion evicts.
  const int32_t victim = pick_victim();
  if (victim < 0) throw std::logic_error("policy core: no evictable expert (all pinned)");
  const int32_t slot = expert_[victim].slot;
  expert_[victim].slot = -1;
  res_bits_[victim >> 6] &= ~(uint64_t{1} << (victim & 63));
  ++counters_.evictions;
  expert_[e].slot = slot;
  res_bits_[e >> 6] |= uint64_t{1} << (e & 63);
  expert_in_slot_[slot] = e;
  set_key(slot, eviction_key(e));
  return {slot, victim};
}

int32_t LayerCache::apply_ready_admissions() {
  // Requests are queued in token order with one delay, so the ready ones are a prefix of the
  // queue, all made delay tokens ago; among them the lower expert id goes first.
  if (queue_.empty() || queue_.front().first > t_) return 0;
  auto ready = queue_.begin();
  while (ready != queue_.end() && ready->first <= t_) ++ready;
  std::sort(queue_.begin(), ready);
  int32_t inserted = 0;
  for (auto it = queue_.begin(); it != ready; ++it) {
    const int32_t e = it->second;
    expert_[e].pending = false;
    if (expert_[e].slot >= 0) continue;
    insert(e);
    ++inserted;
  }
  counters_.admissions += inserted;
  queue_.erase(queue_.begin(), ready);
  return inserted;
}

// A background admission of e (beta's or a host upload): pending, queued with ready time
// t + delay (or handed to the caller with external admission), counted as a request.
void LayerCache::request_admission(int32_t e, const StepOut& out) {
  expert_[e].pending = true;
  ++counters_.admission_requests;
  if (!external_) queue_.emplace_back(t_ + p_.delay, e);
  if (out.admissions) out.admissions->emplace_back(t_, e);
}

void LayerCache::set_future(const Future* future) {
  if (t_ != 0) throw std::logic_error("set_future: the cache has already stepped");
  if (future->k != k_ || static_cast<int>(future->first_use.size()) != E_)
    throw std::invalid_argument("set_future: the future's k or E differs from the cache's");
  future_ = future;
  upcoming_ = future->first_use;
  for (int s = 0; s < C_; ++s) set_key(s, eviction_key(expert_in_slot_[s]));
}

// Step 1b: P = the n largest lookahead logits (the caller's top-n); each one not resident is
// inserted. All of P is pinned while it runs (n <= C, so a victim always exists and all of P is
// resident after it). Returns the number inserted.
int32_t LayerCache::prefetch(const int32_t* P) {
  const int n = p_.prefetch;
  bool all_resident = true;  // the common case: nothing to insert, nothing to pin
  for (int j = 0; j < n; ++j) all_resident &= is_resident(P[j]);
  if (all_resident) return 0;
  for (int j = 0; j < n; ++j)
    if (expert_[P[j]].slot >= 0) pin(expert_[P[j]].slot);
  int32_t inserted = 0;
  for (int j = 0; j < n; ++j) {
    const int32_t e = P[j];
    if (expert_[e].slot >= 0) continue;
    pin(insert(e).first);
    acc_[e] = 0.0;
    ++inserted;
  }
  for (int j = 0; j < n; ++j) set_key(expert_[P[j]].slot, eviction_key(P[j]));
  counters_.prefetches += inserted;
  return inserted;
}

// Step 2 with route_bias: S = the k largest biased logits z' (z + b for residents, z otherwise,
// float64), ranked by z' (ties to the lower id). z' >= z, so S's k-th value is at least T0's
// k-th logit `thr`; a non-resident outside T0 is outranked by all of T0, so S is drawn from T0
// and the residents with z + b >= thr.
double LayerCache::biased_selection(const float* z, const int32_t* sel0, const double* w0,
                                    double b, int32_t* sel, double* w) {
  const double thr = z[sel0[k_ - 1]];
  // Most tokens: all of T0 resident, every member gains b. Then S = T0 unless rounding z + b
  // merges values: T0 must stay in (z' descending, id ascending) order, and the best outsider
  // (at most the float below thr; one equal to thr has a higher id than T0's) must stay below.
  bool all_resident = true;
  for (int r = 0; r < k_; ++r) all_resident &= is_resident(sel0[r]);
  if (all_resident) {
    double prev = static_cast<double>(z[sel0[0]]) + b;
    bool ordered = true;
    for (int r = 1; r < k_; ++r) {
      const double v = static_cast<double>(z[sel0[r]]) + b;
      ordered &= v < prev || (v == prev && sel0[r] > sel0[r - 1]);
      prev = v;
    }
    if (ordered && static_cast<double>(next_below(z[sel0[k_ - 1]])) + b < prev) {
      std::copy(sel0, sel0 + k_, sel);
      std::copy(w0, w0 + k_, w);
      return 0.0;
    }
  }
  double val[kMaxTopK];
  int8_t t0_rank[kMaxTopK];  // S's member's rank in T0, or -1 for an outsider
  int n = 0;
  auto offer = [&](double v, int32_t e, int8_t rank) {  // insertion by (v desc, id asc)
    if (n == k_ && !(v > val[k_ - 1] || (v == val[k_ - 1] && e < sel[k_ - 1]))) return;
    int pos = n < k_ ? n++ : k_ - 1;
    while (pos > 0 && (v > val[pos - 1] || (v == val[pos - 1] && e < sel[pos - 1]))) {
      val[pos] = val[pos - 1];
      sel[pos] = sel[pos - 1];
      t0_rank[pos] = t0_rank[pos - 1];
      --pos;
    }
    val[pos] = v;
    sel[pos] = e;
    t0_rank[pos] = rank;
  };
  for (int r = 0; r < k_; ++r) {
    const int32_t e = sel0[r];
    offer(is_resident(e) ? static_cast<double>(z[e]) + b : z[e], e, static_cast<int8_t>(r));
    t0_bits_[e >> 6] |= uint64_t{1} << (e & 63);
  }
  // Outsiders: residents with z + b >= thr, among the experts with z >= outsider_floor
  mask_at_least(z, E_, outsider_floor(thr, b), cand_bits_.data());
  for (size_t i = 0; i < res_bits_.size(); ++i) {
    for (uint64_t m = cand_bits_[i] & res_bits_[i] & ~t0_bits_[i]; m; m &= m - 1) {
      const int32_t e = static_cast<int32_t>(64 * i) + __builtin_ctzll(m);
      const double v = static_cast<double>(z[e]) + b;
      if (v >= thr) offer(v, e, -1);
    }
    t0_bits_[i] = 0;
  }
  bool same = true;
  uint64_t kept = 0;  // bit r: T0's rank-r expert is in S
  for (int r = 0; r < k_; ++r) {
    same &= t0_rank[r] == r;
    kept |= t0_rank[r] >= 0 ? uint64_t{1} << t0_rank[r] : 0;
  }
  if (same) {  // the same ranking: v1's weights, nothing rerouted
    std::copy(w0, w0 + k_, w);
    return 0.0;
  }
  float v[kMaxTopK];
  for (int r = 0; r < k_; ++r) v[r] = z[sel[r]];
  softmax_row(v, k_, w);
  double rho = 0.0;  // T0's own weights of its experts that S left out, in T0's rank order
  for (int r = 0; r < k_; ++r)
    if (!(kept >> r & 1)) rho += w0[r];
  return rho;
}

std::pair<int32_t, int32_t> LayerCache::admit(int32_t e) {
  if (!external_) throw std::invalid_argument("admit() needs external_admission=True");
  if (e < 0 || e >= E_ || !expert_[e].pending)
    throw std::invalid_argument("admit(): expert has no pending admission");
  expert_[e].pending = false;
  if (expert_[e].slot >= 0) return {expert_[e].slot, -1};
  ++counters_.admissions;
  return insert(e);  // between tokens nothing is pinned
}

void LayerCache::step(const float* logits, int64_t T, int64_t row_stride, const StepOut& out,
                      const float* lookahead, int64_t lookahead_stride) {
  for (int64_t i = 0; i < T; ++i) {
    const float* z = logits + i * row_stride;
    float vals[kMaxTopK], zmin = 0.0f;
    if (!select_topk(z, E_, k_, sel_.data(), vals, p_.route_bias > 0.0 ? &zmin : nullptr))
      throw NonFiniteLogits(i);
    gate_weights(vals, 1, k_, w_.data());
    const int32_t* pref = nullptr;
    if (p_.prefetch > 0 && lookahead) {
      if (!select_topk(lookahead + i * lookahead_stride, E_, p_.prefetch, pref_ids_.data(),
                       pref_vals_.data()))
        throw NonFiniteLookahead(i);
      pref = pref_ids_.data();
    }
    step_selected(z, sel_.data(), w_.data(), out, i, pref, zmin);
  }
}

void LayerCache::step_selected(const float* z, const int32_t* sel0, const double* w0,
                               const StepOut& out, int64_t i, const int32_t* pref, float zmin) {
  if (t_ >= kMaxTokens)
    throw std::invalid_argument("a layer cache holds at most 2^31 - 2 tokens of one stream");
  if (p_.prefetch > 0 && !pref)
    throw std::invalid_argument("policy prefetch > 0 needs lookahead");
  if (p_.substitute_by == SubstituteBy::Coactivation && !coact_)
    throw std::invalid_argument("policy substitute_by 'coactivation' needs a coactivation table");
  if (p_.eviction == Eviction::Belady &&
      (!future_ || t_ >= static_cast<int64_t>(future_->next_after.size()) / k_))
    throw std::invalid_argument(
        "policy eviction 'belady' needs the whole stream's future: scan and the simulator only");
  if (p_.route_bias > 0.0 && !(zmin <= z[sel0[0]]))
    throw std::invalid_argument("policy route_bias > 0 needs the row's smallest logit");
  const int64_t requests_before = counters_.admission_requests;
  // 1. admissions that are ready
  const int32_t n_admitted = external_ ? 0 : apply_ready_admissions();
  // 1b. prefetch from the lookahead logits
  const int32_t n_prefetched = p_.prefetch > 0 ? prefetch(pref) : 0;
  // 2. selection: the caller's unbiased top-k (sel0, w0), re-selected with route_bias
  int32_t sel_biased[kMaxTopK];
  double w_biased[kMaxTopK];
  const int32_t* sel = sel0;
  const double* w = w0;
  double rho = 0.0;
  if (p_.route_bias > 0.0) {
    const double b = p_.route_bias * (static_cast<double>(z[sel0[0]]) - zmin);  // lambda x range
    rho = biased_selection(z, sel0, w0, b, sel_biased, w_biased);
    sel = sel_biased;
    w = w_biased;
  }
  if (future_)  // belady: from here on, "next" starts after this token
    for (int r = 0; r < k_; ++r) upcoming_[sel[r]] = future_->next_after[t_ * k_ + r];
  const int64_t o = i * out.k_stride;
  int8_t st[kMaxTopK];
  int32_t ids[kMaxTopK], slots[kMaxTopK];
  if (p_.eviction == Eviction::Lfu)  // only lfu's keys count selections
    for (int r = 0; r < k_; ++r) ++expert_[sel[r]].freq;
  // 3. classify; hits join the computed set at once, which pins them (pin: the largest key)
  for (int r = 0; r < k_; ++r) {
    const int32_t e = sel[r];
    ids[r] = e;
    slots[r] = expert_[e].slot;
    if (slots[r] >= 0) {
      st[r] = HIT;
      pin(slots[r]);
      continue;
    }
    switch (p_.rule) {
      case Rule::FetchAll: st[r] = FETCH; break;
      case Rule::SubstituteAll: st[r] = SUB; break;
      case Rule::FirstChoice: st[r] = r == 0 ? FETCH : SUB; break;
      case Rule::Threshold: st[r] = (r == 0 || w[r] >= p_.tau) ? FETCH : SUB; break;
      case Rule::HostCompute: st[r] = HOST; break;
    }
    if (st[r] == SUB && p_.light_miss == LightMiss::Host) st[r] = HOST;  // the lossless hybrid
  }
  // 4. fetches in rank order
  for (int r = 0; r < k_; ++r) {
    if (st[r] != FETCH) continue;
    const int32_t e = sel[r];
    slots[r] = insert(e).first;
    pin(slots[r]);
    acc_[e] = 0.0;
  }
  // 5. substitutions in rank order; candidates are the residents not pinned by now
  double m = 0.0;
  bool candidates_ready = false;
  for (int r = 0; r < k_; ++r) {
    if (st[r] != SUB) continue;
    const int32_t e = sel[r];
    if (!candidates_ready) {  // residents, less the computed set so far (hits, fetches)
      for (int s = 0; s < C_; ++s) zs_[s] = z[expert_in_slot_[s]];
      for (int q = 0; q < k_; ++q)
        if (st[q] == HIT || st[q] == FETCH) zs_[slots[q]] = kExcluded;
      candidates_ready = true;
    }
    const int32_t s =
        p_.substitute_by == SubstituteBy::Coactivation
            ? best_coactivated(coact_ + static_cast<int64_t>(e) * E_, zs_.data(),
                               expert_in_slot_.data(), C_)
            : best_substitute(zs_.data(), expert_in_slot_.data(), C_);
    if (s < 0) {  // unreachable with a full cache and k <= C; kept for the contract
      st[r] = FORCED;
      slots[r] = insert(e).first;
      pin(slots[r]);
      zs_[slots[r]] = kExcluded;
      acc_[e] = 0.0;
      continue;
    }
    ids[r] = s;
    slots[r] = expert_[s].slot;
    pin(slots[r]);
    zs_[slots[r]] = kExcluded;
    m += w[r];
    acc_[e] += w[r];
    if (p_.beta > 0.0 && acc_[e] >= p_.beta && !expert_[e].pending) {
      acc_[e] = 0.0;
      request_admission(e, out);
    }
  }
  // host uploads: the HOST experts in rank order, each without a pending admission, at most
  // host_admit of them (acc untouched)
  for (int r = 0, left = p_.host_admit; r < k_ && left > 0; ++r)
    if (st[r] == HOST && !expert_[sel[r]].pending) {
      request_admission(sel[r], out);
      --left;
    }
  // 6. recency, which also unpins the computed residents; counters
  int64_t per_status[5] = {};
  for (int r = 0; r < k_; ++r) {
    expert_[ids[r]].last = static_cast<int32_t>(t_);
    ++per_status[st[r]];
    if (st[r] == HOST)
      slots[r] = -1;
    else
      set_key(slots[r], eviction_key(ids[r]));
  }
  counters_.hit += per_status[HIT];
  counters_.fetch += per_status[FETCH];
  counters_.sub += per_status[SUB];
  counters_.host += per_status[HOST];
  counters_.forced += per_status[FORCED];
  counters_.rerouted += rho;
  ++counters_.tokens;
  // k is small: plain stores beat a memmove call per array
  if (out.ids) for (int r = 0; r < k_; ++r) out.ids[o + r] = ids[r];
  if (out.status) for (int r = 0; r < k_; ++r) out.status[o + r] = st[r];
  if (out.selected) for (int r = 0; r < k_; ++r) out.selected[o + r] = sel[r];
  if (out.weights) for (int r = 0; r < k_; ++r) out.weights[o + r] = w[r];
  if (out.slot) for (int r = 0; r < k_; ++r) out.slot[o + r] = slots[r];
  if (out.mass) out.mass[i * out.mass_stride] = m;
  if (out.rerouted) out.rerouted[i * out.mass_stride] = rho;
  if (out.prefetched) out.prefetched[i * out.mass_stride] = n_prefetched;
  const int32_t n_requested = static_cast<int32_t>(counters_.admission_requests - requests_before);
  if (out.requested) out.requested[i * out.mass_stride] = n_requested;
  if (out.admitted) out.admitted[i * out.mass_stride] = n_admitted;
  if (out.counts) {
    int16_t* c = out.counts + i * out.counts_stride;
    for (int f = kCountHit; f <= kCountForced; ++f) c[f] = static_cast<int16_t>(per_status[f]);
    c[kCountPrefetched] = static_cast<int16_t>(n_prefetched);
    c[kCountRequests] = static_cast<int16_t>(n_requested);
    c[kCountAdmissions] = static_cast<int16_t>(n_admitted);
  }
  ++t_;
}

Future layer_future(const float* logits, int64_t T, int64_t row_stride, int E, int k) {
  Future f;
  f.k = k;
  f.sel.resize(T * k);
  std::vector<float> vals(k);
  for (int64_t t = 0; t < T; ++t)
    if (!select_topk(logits + t * row_stride, E, k, &f.sel[t * k], vals.data()))
      throw NonFiniteLogits(t);
  // backwards: `first_use` holds each expert's next selection after t, then its first one
  f.next_after.resize(T * k);
  f.first_use.assign(E, Future::kNever);
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int r = 0; r < k; ++r) f.next_after[t * k + r] = f.first_use[f.sel[t * k + r]];
    for (int r = 0; r < k; ++r) f.first_use[f.sel[t * k + r]] = static_cast<int32_t>(t);
  }
  return f;
}

void coactivation_counts(const float* logits, int64_t T, int64_t row_stride, int E, int k,
                         int64_t* counts) {
  int32_t sel[kMaxTopK];
  float vals[kMaxTopK];
  for (int64_t t = 0; t < T; ++t) {
    if (!select_topk(logits + t * row_stride, E, k, sel, vals)) throw NonFiniteLogits(t);
    for (int a = 0; a < k; ++a)
      for (int b = 0; b < k; ++b) ++counts[static_cast<int64_t>(sel[a]) * E + sel[b]];
  }
}

int64_t belady_hits(const float* logits, int64_t T, int64_t row_stride, int E, int k, int C,
                    const int32_t* initial) {
  const Future f = layer_future(logits, T, row_stride, E, k);
  // `next_use` starts as each expert's first selection: the next use of the initial residents.
  std::vector<int32_t> next_use = f.first_use;
  std::vector<int32_t> resident;
  std::vector<uint8_t> is_res(E, 0);
  std::vector<int64_t> stamp(E, -1);
  for (int s = 0; s < C; ++s) {
    const int32_t e = initial ? initial[s] : s;
    resident.push_back(e);
    is_res[e] = 1;
  }
  int64_t hits = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* S = &f.sel[t * k];
    for (int r = 0; r < k; ++r) stamp[S[r]] = t;
    for (int r = 0; r < k; ++r) {
      const int32_t e = S[r];
      if (is_res[e]) {
        ++hits;
      } else {
        size_t vi = 0;
        int64_t far = -1;
        for (size_t i = 0; i < resident.size(); ++i) {
          const int32_t x = resident[i];
          if (stamp[x] == t) continue;
          if (next_use[x] > far || (next_use[x] == far && x < resident[vi])) {
            far = next_use[x];
            vi = i;
          }
        }
        is_res[resident[vi]] = 0;
        resident[vi] = e;
        is_res[e] = 1;
      }
    }
    for (int r = 0; r < k; ++r) next_use[S[r]] = f.next_after[t * k + r];
  }
  return hits;
}

}  // namespace moesub
