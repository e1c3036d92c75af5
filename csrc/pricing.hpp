// Overlap-aware pricing of one stream's per-token-layer counts (moesub.pricing, whose
// price_stream_reference is the specification): one clock for the fast tier, one FIFO link for
// every copy, admissions landing `delay` tokens after their request, prefetches issued one MoE
// layer early, host experts beside (concurrent) or after the fast tier's, their reads on the
// link where the host reads its experts over it (a disk tier), the fast tier's work slowed
// while that link reads, and a batch of background copies that finds none on the link starts
// the idle background lane.
#pragma once

#include <cstdint>

namespace moesub {

// Field order of a token-layer's counts (moesub.pricing.TOKEN_LAYER_FIELDS).
enum PriceField { kHit, kFetch, kSub, kHost, kForced, kPrefetched, kRequests, kLanded, kFields };
// Where the seconds went (moesub.pricing.BREAKDOWN), then the hidden host seconds.
enum PricePart {
  kOverhead, kDense, kAdmitWait, kPrefetchWait, kInstall, kLinkWait, kSyncCopy, kFastCompute,
  kHostExposed, kReadDrag, kBackgroundStart, kHiddenHost, kParts
};

struct UnitCosts {
  double copy_s, expert_s, host_expert_s, dense_layer_s, token_overhead_s, install_s;
  bool concurrent_host;
  bool host_reads_link;  // the host's experts come over the link (queued behind its copies)
  // the fast tier's work slows by these fractions while the link reads (host_reads_link only):
  // the host's experts, background copies
  double host_read_drag, background_read_drag;
  // a step that copies synchronously: issuing the copies and resuming after the wait, once
  double sync_step_s;
  // one of the host's reads over the link (host_reads_link only): its reads come back to back
  double host_read_s;
  // a step that computes experts on the host, once: handing them over and taking the results
  double host_step_s;
  // a batch of background copies queued while none is still on the link: starting the lane
  double background_start_s;
};

// counts: (T, L, kFields) row-major; token_s: (T,) out; parts: (kParts,) out (summed over the
// stream). Throws std::invalid_argument on a negative count.
template <typename Int>
void price_stream(const Int* counts, int64_t T, int64_t L, int64_t delay, const UnitCosts& u,
                  double* token_s, double* parts);

}  // namespace moesub
