// Overlap-aware pricing: moesub.pricing.price_stream_reference, operation for operation (the
// same additions in the same order, so both give the same bits: tests/test_pricing.py).
#include "pricing.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace moesub {

// A stretch of time [a, b) in which the fast tier's work runs `1 + drag` times slower than alone.
struct DragWindow {
  double a, b, drag;
};

// The end of `work` seconds of the fast tier's work from `start` (`plain`: start + work, as the
// caller added it), slowed in each of n windows (in time order, apart): `plain` where none
// slows it.
static double dragged_end(double start, double work, double plain, const DragWindow* w, int n) {
  double t = start, rest = work;
  bool slowed = false;
  for (int i = 0; i < n; ++i) {
    const DragWindow& x = w[i];
    if (x.drag == 0.0 || x.a >= x.b || x.b <= t || t + rest <= x.a) continue;
    if (x.a > t) {  // full speed up to the window
      rest -= x.a - t;
      t = x.a;
    }
    const double fits = (x.b - t) / (1.0 + x.drag);  // the work the window holds
    slowed = true;
    if (rest <= fits) return t + rest * (1.0 + x.drag);
    rest -= fits;
    t = x.b;
  }
  return slowed ? t + rest : plain;
}

template <typename Int>
void price_stream(const Int* counts, int64_t T, int64_t L, int64_t delay, const UnitCosts& u,
                  double* token_s, double* parts) {
  double p[kParts] = {};  // the parts, in registers while the loop runs
  double clock = 0.0, link_free = 0.0;
  double background_free = 0.0;  // when the link has carried every background copy queued
  const double host_drag = u.host_reads_link ? u.host_read_drag : 0.0;
  const double background_drag = u.host_reads_link ? u.background_read_drag : 0.0;
  // n reads of `each` seconds queued at `at` behind those already queued: when the first starts
  auto enqueue = [&](double at, int64_t n, double each) {
    const double start = std::max(at, link_free);
    link_free = start + static_cast<double>(n) * each;
    return start;
  };
  // n background copies queued at `at`: when the first starts; `started` gets the fast tier's
  // seconds to start the lane (where no background copy was still on the link, else 0)
  auto background = [&](double at, int64_t n, double& started) {
    started = (n && background_free <= at) ? u.background_start_s : 0.0;
    const double start = enqueue(at, n, u.copy_s);
    if (n) background_free = link_free;
    p[kBackgroundStart] += started;
    return start;
  };
  // the fast tier's `seconds` of `part` from `start`: when they end, slowed while the link reads
  // background copies (those queued so far run back to back from `start` until `link_free`; the
  // host's reads are done by then)
  auto work = [&](double start, double seconds, int part) {
    const double plain = start + seconds;
    const DragWindow window{start, link_free, background_drag};
    const double end = dragged_end(start, seconds, plain, &window, 1);
    p[part] += seconds;
    p[kReadDrag] += end - plain;
    return end;
  };
  // admission requests per (layer, token % delay): start on the link, copies
  const int64_t ring = std::min<int64_t>(delay, std::max<int64_t>(T, 1));
  std::vector<double> req_start(L * ring, 0.0);
  std::vector<int64_t> req_n(L * ring, 0);
  std::vector<double> prefetch_done(L, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double begin = clock;
    const int64_t phase = t % delay;
    clock = work(clock, u.token_overhead_s, kOverhead);
    for (int64_t l = 0; l < L; ++l) {
      const Int* c = counts + (t * L + l) * kFields;
      Int sign = 0;
      for (int f = 0; f < kFields; ++f) sign |= c[f];
      if (sign < 0)
        throw std::invalid_argument("counts: negative count at token " + std::to_string(t) +
                                    ", layer " + std::to_string(l));
      // prefetch copies: layer 0's at the token's start, layer l+1's after layer l's dense
      // work. Queueing none moves link_free up to `at` only, which changes no later start (the
      // clock never goes back), and starts nothing, so it is done without a branch.
      const int64_t pf = c[kPrefetched];
      double started;
      if (l == 0) {
        prefetch_done[0] = background(clock, pf, started) + static_cast<double>(pf) * u.copy_s;
        clock += started;
      }
      clock = work(clock, u.dense_layer_s, kDense);
      if (l + 1 < L) {
        const int64_t next = c[kFields + kPrefetched];
        prefetch_done[l + 1] =
            background(clock, next, started) + static_cast<double>(next) * u.copy_s;
        clock += started;
      }
      // step 1: landing admissions wait for their copies, then are installed; step 1b: the
      // prefetched experts. Selects, not branches (adding 0.0 changes no bit).
      const int64_t slot = l * ring + phase;
      const int64_t landed = std::min<int64_t>(c[kLanded], req_n[slot]);
      const double admitted =
          landed ? std::max(clock, req_start[slot] + static_cast<double>(landed) * u.copy_s)
                 : clock;
      p[kAdmitWait] += admitted - clock;
      clock = admitted;
      clock = work(clock, static_cast<double>(c[kLanded]) * u.install_s, kInstall);
      const double prefetched = pf ? std::max(clock, prefetch_done[l]) : clock;
      p[kPrefetchWait] += prefetched - clock;
      clock = prefetched;
      clock = work(clock, static_cast<double>(pf) * u.install_s, kInstall);
      // the decision: synchronous copies, then the host's reads where it reads over the link,
      // then the new background requests (the engine starts them once the host's reads are
      // done), on the link
      const double decided = clock;
      const int64_t n_sync = static_cast<int64_t>(c[kFetch]) + c[kForced];
      const double sync_start = n_sync ? enqueue(decided, n_sync, u.copy_s) : decided;
      const int64_t host_reads = u.host_reads_link ? static_cast<int64_t>(c[kHost]) : 0;
      double reads = host_reads ? enqueue(decided, host_reads, u.host_read_s) : 0.0;
      req_start[slot] = background(decided, c[kRequests], started);
      req_n[slot] = c[kRequests];
      // the fast path: the synchronous copies (and the step's wait for them), starting the
      // background lane for the requests, then the fast tier's experts
      const int64_t n_fast = static_cast<int64_t>(c[kHit]) + c[kFetch] + c[kSub] + c[kForced];
      const double copies =
          static_cast<double>(n_sync) * u.copy_s + (n_sync ? u.sync_step_s : 0.0);
      const double experts = static_cast<double>(n_fast) * u.expert_s;
      const double fast_end = sync_start + (copies + started + experts);
      p[kLinkWait] += sync_start - decided;
      p[kSyncCopy] += copies;
      p[kFastCompute] += experts;
      // the host path: its experts computed beside the fast path from the decision on, or
      // after it; where the host reads them over the link, the reads queue behind every copy
      // queued before and the host computes once they are done (one processor: they overlap
      // the fast path, the host's compute follows)
      const double host =
          static_cast<double>(c[kHost]) * u.host_expert_s + (c[kHost] ? u.host_step_s : 0.0);
      double ready = decided;  // where the host reads nothing over the link
      double reads_end;
      if (host_reads) {
        ready = reads_end = reads + static_cast<double>(host_reads) * u.host_read_s;
      } else {  // the background copies queued so far run to the link's end
        reads = reads_end = link_free;
      }
      // the fast tier's experts slowed while the link reads: the background copies queued
      // before, the host's reads, then this decision's background requests
      const double fast_start = sync_start + (copies + started);
      const DragWindow windows[3] = {{fast_start, reads, background_drag},
                                     {reads, reads_end, host_drag},
                                     {reads_end, link_free, background_drag}};
      const double fast_done = dragged_end(fast_start, experts, fast_end, windows, 3);
      p[kReadDrag] += fast_done - fast_end;
      double end;
      if (u.concurrent_host) {
        end = std::max(fast_done, ready + host);
        p[kHiddenHost] += std::min(host, std::max(0.0, fast_done - ready));
        p[kHostExposed] += end - fast_done;
      } else {  // on the one processor: slowed while the link reads this step's requests
        const double host_start = std::max(fast_done, ready);
        const double plain = host_start + host;
        const DragWindow uploads{reads_end, link_free, background_drag};
        end = dragged_end(host_start, host, plain, &uploads, 1);
        p[kHostExposed] += plain - fast_done;
        p[kReadDrag] += end - plain;
      }
      clock = end;
    }
    token_s[t] = clock - begin;
  }
  std::copy(p, p + kParts, parts);
}

template void price_stream<int32_t>(const int32_t*, int64_t, int64_t, int64_t, const UnitCosts&,
                                    double*, double*);
template void price_stream<int64_t>(const int64_t*, int64_t, int64_t, int64_t, const UnitCosts&,
                                    double*, double*);

}  // namespace moesub
