#include "policy.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace moesub {

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

void select_topk(const float* z, int E, int k, int32_t* ids, float* vals) {
  // Fast path: the k-th largest block maximum is a lower bound on the k-th largest logit, so
  // only the few logits reaching it are candidates; candidates are then placed by their rank
  // (logit descending, ties to the lower id) without data-dependent branches.
  // Reference path (small E): plain insertion over all experts.
  constexpr int B = 16, kMaxE = 4096;
  const int nb = E / B;
  if (nb < k || E > kMaxE) {
    int n = 0;
    for (int e = 0; e < E; ++e) topk_insert(z[e], e, k, n, ids, vals);
    return;
  }
  float bmax[kMaxE / B];
  for (int b = 0; b < nb; ++b) {
    const float* zb = z + b * B;
    float m = zb[0];
    for (int i = 1; i < B; ++i) m = zb[i] > m ? zb[i] : m;
    bmax[b] = m;
  }
  // thr = the k-th largest block maximum: the smallest maximum with fewer than k above it
  float thr = std::numeric_limits<float>::infinity();
  for (int b = 0; b < nb; ++b) {
    int above = 0;
    for (int j = 0; j < nb; ++j) above += bmax[j] > bmax[b];
    thr = (above < k && bmax[b] < thr) ? bmax[b] : thr;
  }
  int32_t cand[kMaxE];
  float cval[kMaxE];
  int nc = 0;
  for (int b = 0; b < nb; ++b) {
    if (bmax[b] < thr) continue;
    for (int e = b * B; e < (b + 1) * B; ++e) {
      cand[nc] = e;
      cval[nc] = z[e];
      nc += z[e] >= thr;
    }
  }
  for (int e = nb * B; e < E; ++e) {  // ragged tail
    cand[nc] = e;
    cval[nc] = z[e];
    nc += z[e] >= thr;
  }
  for (int i = 0; i < nc; ++i) {  // candidates are in id order: j < i means a lower id
    int rank = 0;
    for (int j = 0; j < nc; ++j) rank += (cval[j] > cval[i]) | ((cval[j] == cval[i]) & (j < i));
    if (rank < k) {
      ids[rank] = cand[i];
      vals[rank] = cval[i];
    }
  }
}

void gate_weights(const float* vals, int k, double* w) {
  const double z1 = vals[0];
  double sum = 0.0;
  for (int r = 0; r < k; ++r) {
    w[r] = std::exp(static_cast<double>(vals[r]) - z1);
    sum += w[r];
  }
  for (int r = 0; r < k; ++r) w[r] /= sum;
}

LayerCache::LayerCache(int E, int k, int C, PolicyParams p, const int32_t* initial, bool external)
    : E_(E), k_(k), C_(C), p_(p), external_(external), slot_of_(E, -1), expert_in_slot_(C, -1),
      freq_(E, 0), last_(E, -1), acc_(E, 0.0), pending_(E, 0), stamp_(E, -1), sel_(k), vals_(k),
      w_(k) {
  if (k < 1 || k > kMaxTopK || C < k || C > E)
    throw std::invalid_argument("need 1 <= k <= capacity <= num_experts and k <= 64");
  for (int s = 0; s < C; ++s) {
    const int32_t e = initial ? initial[s] : s;
    if (e < 0 || e >= E || slot_of_[e] != -1)
      throw std::invalid_argument("initial resident set must hold distinct experts in [0, E)");
    slot_of_[e] = s;
    expert_in_slot_[s] = e;
  }
}

int32_t LayerCache::pick_victim() const {
  int32_t best = -1;
  for (int s = 0; s < C_; ++s) {
    const int32_t e = expert_in_slot_[s];
    if (e < 0 || stamp_[e] == t_) continue;  // empty, or pinned by the current token
    if (best < 0) {
      best = e;
      continue;
    }
    bool less;
    if (p_.eviction == Eviction::Lfu && freq_[e] != freq_[best])
      less = freq_[e] < freq_[best];
    else if (last_[e] != last_[best])
      less = last_[e] < last_[best];
    else
      less = e < best;
    if (less) best = e;
  }
  return best;
}

int32_t LayerCache::insert(int32_t e) {
  // The cache is always full (it starts from C residents), so every insertion evicts.
  const int32_t victim = pick_victim();
  if (victim < 0) throw std::logic_error("policy core: no evictable expert (all pinned)");
  const int32_t slot = slot_of_[victim];
  slot_of_[victim] = -1;
  ++counters_.evictions;
  slot_of_[e] = slot;
  expert_in_slot_[slot] = e;
  return slot;
}

int32_t best_substitute(const float* z, const int32_t* resident, int C, const int64_t* stamp,
                        int64_t t) {
  int32_t best = -1;
  for (int s = 0; s < C; ++s) {
    const int32_t e = resident[s];
    if (e < 0 || stamp[e] == t) continue;  // not resident, or already in the computed set
    if (best < 0 || z[e] > z[best] || (z[e] == z[best] && e < best)) best = e;
  }
  return best;
}

void forced_substitution(const float* logits, int64_t T, int E, int k, const int32_t* resident,
                         int C, const uint8_t* sub_mask, int32_t* ids, double* weights,
                         int32_t* selected) {
  std::vector<int64_t> stamp(E, -1);
  std::vector<float> vals(k);
  for (int64_t t = 0; t < T; ++t) {
    const float* z = logits + t * E;
    int32_t* sel = selected + t * k;
    select_topk(z, E, k, sel, vals.data());
    gate_weights(vals.data(), k, weights + t * k);
    // Every selected expert that is not substituted is computed exactly; a substituted one
    // cannot stand in for itself or for another selected expert either.
    for (int r = 0; r < k; ++r) {
      ids[t * k + r] = sel[r];
      stamp[sel[r]] = t;
    }
    for (int r = 0; r < k; ++r) {
      if (!sub_mask[t * k + r]) continue;
      const int32_t s = best_substitute(z, resident, C, stamp.data(), t);
      if (s < 0) throw std::invalid_argument("forced_substitution: no substitute candidate left");
      ids[t * k + r] = s;
      stamp[s] = t;
    }
  }
}

void LayerCache::apply_ready_admissions() {
  while (!queue_.empty() && queue_.begin()->first <= t_) {
    const int32_t e = queue_.begin()->second;
    queue_.erase(queue_.begin());
    pending_[e] = 0;
    if (slot_of_[e] >= 0) continue;
    insert(e);
    ++counters_.admissions;
  }
}

std::pair<int32_t, int32_t> LayerCache::admit(int32_t e) {
  if (!external_) throw std::invalid_argument("admit() needs external_admission=True");
  if (e < 0 || e >= E_ || !pending_[e])
    throw std::invalid_argument("admit(): expert has no pending admission");
  pending_[e] = 0;
  if (slot_of_[e] >= 0) return {slot_of_[e], -1};
  // Between tokens nothing is pinned: stamps hold earlier tokens only.
  const int32_t evicted = pick_victim();
  const int32_t slot = insert(e);
  ++counters_.admissions;
  return {slot, evicted};
}

void LayerCache::step(const float* logits, int64_t T, int64_t row_stride, const StepOut& out) {
  const bool host = p_.rule == Rule::HostCompute;
  for (int64_t i = 0; i < T; ++i, ++t_) {
    const float* z = logits + i * row_stride;
    // 1. admissions that are ready
    if (!external_) apply_ready_admissions();
    // 2. selection
    select_topk(z, E_, k_, sel_.data(), vals_.data());
    gate_weights(vals_.data(), k_, w_.data());
    const int64_t o = i * out.k_stride;
    int8_t st[kMaxTopK];
    int32_t ids[kMaxTopK], slots[kMaxTopK];
    for (int r = 0; r < k_; ++r) ++freq_[sel_[r]];
    // 3. classify; hits join the computed set (and are pinned) at once
    for (int r = 0; r < k_; ++r) {
      const int32_t e = sel_[r];
      ids[r] = e;
      slots[r] = slot_of_[e];
      if (slot_of_[e] >= 0) {
        st[r] = HIT;
        stamp_[e] = t_;
        continue;
      }
      switch (p_.rule) {
        case Rule::FetchAll: st[r] = FETCH; break;
        case Rule::SubstituteAll: st[r] = SUB; break;
        case Rule::FirstChoice: st[r] = r == 0 ? FETCH : SUB; break;
        case Rule::Threshold: st[r] = (r == 0 || w_[r] >= p_.tau) ? FETCH : SUB; break;
        case Rule::HostCompute: st[r] = HOST; break;
      }
      if (host) stamp_[e] = t_;
    }
    // 4. fetches in rank order
    for (int r = 0; r < k_; ++r) {
      if (st[r] != FETCH) continue;
      const int32_t e = sel_[r];
      slots[r] = insert(e);
      stamp_[e] = t_;
      acc_[e] = 0.0;
    }
    // 5. substitutions in rank order
    double m = 0.0;
    for (int r = 0; r < k_; ++r) {
      if (st[r] != SUB) continue;
      const int32_t e = sel_[r];
      const int32_t s = best_substitute(z, expert_in_slot_.data(), C_, stamp_.data(), t_);
      if (s < 0) {  // unreachable with a full cache and k <= C; kept for the contract
        st[r] = FORCED;
        slots[r] = insert(e);
        stamp_[e] = t_;
        acc_[e] = 0.0;
        continue;
      }
      ids[r] = s;
      slots[r] = slot_of_[s];
      stamp_[s] = t_;
      m += w_[r];
      acc_[e] += w_[r];
      if (p_.beta > 0.0 && acc_[e] >= p_.beta && !pending_[e]) {
        pending_[e] = 1;
        acc_[e] = 0.0;
        ++counters_.admission_requests;
        if (!external_) queue_.emplace(t_ + p_.delay, e);
        if (out.admissions) out.admissions->emplace_back(t_, e);
      }
    }
    // 6. recency; outputs; counters
    for (int r = 0; r < k_; ++r) {
      last_[ids[r]] = t_;
      switch (st[r]) {
        case HIT: ++counters_.hit; break;
        case FETCH: ++counters_.fetch; break;
        case SUB: ++counters_.sub; break;
        case HOST: ++counters_.host; break;
        case FORCED: ++counters_.forced; break;
      }
      if (st[r] == HOST) slots[r] = -1;
    }
    ++counters_.tokens;
    if (out.ids) std::copy(ids, ids + k_, out.ids + o);
    if (out.status) std::copy(st, st + k_, out.status + o);
    if (out.selected) std::copy(sel_.begin(), sel_.end(), out.selected + o);
    if (out.weights) std::copy(w_.begin(), w_.end(), out.weights + o);
    if (out.slot) std::copy(slots, slots + k_, out.slot + o);
    if (out.mass) out.mass[i * out.mass_stride] = m;
  }
}

int64_t belady_hits(const float* logits, int64_t T, int64_t row_stride, int E, int k, int C,
                    const int32_t* initial) {
  // Selections of every token, then each (token, rank)'s next use of the same expert.
  std::vector<int32_t> sel(T * k);
  std::vector<float> vals(k);
  for (int64_t t = 0; t < T; ++t) select_topk(logits + t * row_stride, E, k, &sel[t * k], vals.data());
  const int64_t never = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> next_after(T * k), upcoming(E, never);
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int r = 0; r < k; ++r) next_after[t * k + r] = upcoming[sel[t * k + r]];
    for (int r = 0; r < k; ++r) upcoming[sel[t * k + r]] = t;
  }
  // `upcoming` now holds each expert's first use: the next use of the initial residents.
  std::vector<int64_t> next_use = upcoming;
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
    const int32_t* S = &sel[t * k];
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
    for (int r = 0; r < k; ++r) next_use[S[r]] = next_after[t * k + r];
  }
  return hits;
}

}  // namespace moesub
