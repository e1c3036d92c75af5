"""Overlap-aware pricing (moesub.pricing): hand-computed examples, and the compiled core held to
the Python reference bit for bit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moesub.hardware import UnitCosts
from moesub.pricing import (
    BREAKDOWN,
    TOKEN_LAYER_FIELDS,
    LayerBlock,
    price_stream,
    price_stream_reference,
    price_streams,
)

PRICERS = (price_stream, price_stream_reference)


def token_layer(**n: int) -> list[int]:
    return [n.get(f, 0) for f in TOKEN_LAYER_FIELDS]


def units(concurrent: bool, copy_s: float = 300.0) -> UnitCosts:
    """Whole numbers (read them as microseconds), so every sum below is exact."""
    return UnitCosts(
        copy_s=copy_s, expert_s=10.0, host_expert_s=50.0, dense_layer_s=20.0,
        token_overhead_s=5.0, install_s=2.0, concurrent_host=concurrent,
    )  # fmt: skip


# two tokens, two MoE layers, delay 1
TWO_TOKENS = np.array(
    [
        [  # token 0
            token_layer(hit=7, fetch=1, host=2, admission_requests=2),
            token_layer(hit=8, sub=1, prefetched=1),
        ],
        [  # token 1: layer 0's two admissions land
            token_layer(hit=6, host=4, admissions=2),
            token_layer(hit=8, fetch=2),
        ],
    ],
    dtype=np.int32,
)


@pytest.mark.parametrize("price", PRICERS)
def test_two_tokens_with_a_concurrent_host(price):
    """copy 300, expert 10, host expert 50, dense 20, token overhead 5, install 2.

    token 0 (starts at 0): overhead -> 5
      layer 0: dense -> 25; layer 1's prefetch (1 copy) queued at 25: link 25-325.
        decision at 25: the fetch waits behind the prefetch: link 325-625 (link_wait 300);
        the 2 admission requests queue behind it: link 625-1225.
        fast path: 325 + 300 (copy) + 8 experts x 10 = 705; host path: 25 + 2 x 50 = 125,
        hidden behind the fast path (100 hidden). Layer ends at 705.
      layer 1: dense -> 725; the prefetch landed at 325 (no wait); install -> 727;
        9 experts -> 817. Token 0 = 817.
    token 1 (starts at 817): overhead -> 822
      layer 0: dense -> 842; the 2 admissions land: their copies end at 625 + 2 x 300 = 1225:
        wait 383 -> 1225; 2 installs -> 1229; fast path 6 experts -> 1289; host path
        1229 + 4 x 50 = 1429: the host is the slower path, 140 exposed (60 hidden) -> 1429.
      layer 1: dense -> 1449; 2 fetches on an idle link: 1449-2049; 10 experts -> 2149.
      Token 1 = 2149 - 817 = 1332.
    """
    r = price(TWO_TOKENS, 1, units(concurrent=True))
    assert r.token_s.tolist() == [817.0, 1332.0]
    assert r.parts == {
        "overhead": 10.0, "dense": 80.0, "admit_wait": 383.0, "prefetch_wait": 0.0,
        "install": 6.0, "link_wait": 300.0, "sync_copy": 900.0, "fast_compute": 330.0,
        "host_exposed": 140.0, "read_drag": 0.0, "background_start": 0.0,
    }  # fmt: skip
    assert r.hidden_host_s == 160.0
    assert sum(r.parts.values()) == r.token_s.sum()


@pytest.mark.parametrize("price", PRICERS)
def test_a_step_that_copies_pays_its_wait_once_on_the_fast_tier(price):
    """The concurrent example with a step's wait of 40 (`sync_step_s`): once per step that
    copies, after its copies, on the fast tier's clock (the link is not held by it).

    token 0, layer 0: the fetch on the link 325-625, then the wait: the fast path is 325 + 300
      + 40 + 80 = 745; layer 1: dense -> 765, install -> 767, 9 experts -> 857. Token 0 = 857.
    token 1 (from 857): overhead -> 862; layer 0: dense -> 882; the admissions' copies still end
      at 1225 (the link did not move): wait 343 -> 1225, and on as before -> 1429. Layer 1:
      dense -> 1449; 2 fetches 1449-2049, one wait -> 2089; 10 experts -> 2189. Token 1 = 1332:
      the wait for the admissions absorbed the first step's 40.
    """
    r = price(TWO_TOKENS, 1, replace(units(concurrent=True), sync_step_s=40.0))
    assert r.token_s.tolist() == [857.0, 1332.0]
    waits = (r.parts["sync_copy"], r.parts["admit_wait"], r.parts["link_wait"])
    assert waits == (980.0, 343.0, 300.0)
    assert sum(r.parts.values()) == r.token_s.sum()


@pytest.mark.parametrize("price", PRICERS)
def test_two_tokens_on_one_processor(price):
    """The same counts without a separate host processor: the host's experts follow the fast
    path's.

    token 0: layer 0 ends at 705 + 100 = 805; layer 1: dense -> 825, install -> 827,
      9 experts -> 917. Token 0 = 917.
    token 1: overhead -> 922; layer 0: dense -> 942; the admissions' copies end at 1225: wait
      283; installs -> 1229; 6 experts -> 1289; 4 host experts -> 1489. Layer 1: dense -> 1509;
      2 fetches 1509-2109; 10 experts -> 2209. Token 1 = 2209 - 917 = 1292.
    Concurrency saves 160 of host time but waits 100 longer for the admissions: 60 in all.
    """
    r = price(TWO_TOKENS, 1, units(concurrent=False))
    assert r.token_s.tolist() == [917.0, 1292.0]
    assert r.parts["admit_wait"] == 283.0
    assert r.parts["host_exposed"] == 300.0
    assert r.hidden_host_s == 0.0
    assert sum(r.parts.values()) == r.token_s.sum()


@pytest.mark.parametrize("price", PRICERS)
@pytest.mark.parametrize(
    ("concurrent", "token_s", "host_exposed", "hidden", "admit_wait"),
    [(False, [947.0, 1292.0], 360.0, 0.0, 253.0), (True, [817.0, 1362.0], 170.0, 190.0, 383.0)],
)
def test_a_step_with_host_experts_pays_its_handover_once_on_the_host_path(
    price, concurrent, token_s, host_exposed, hidden, admit_wait
):
    """The two examples above with a host step of 30 (`host_step_s`): once per step that
    computes experts on the host (layer 0 of both tokens), on the host's path.

    One processor: token 0's layer 0 ends at 705 + 100 + 30 = 835; layer 1: dense -> 855,
      install -> 857, 9 experts -> 947. Token 1 (from 947): overhead, dense -> 972; the
      admissions' copies end at 1225: wait 253; installs -> 1229; 6 experts -> 1289; the host's
      4 experts and its step -> 1519; layer 1: dense -> 1539, 2 fetches 1539-2139, 10 experts
      -> 2239. Token 1 = 1292: the wait for the admissions absorbed token 0's 30.
    Concurrent: token 0's host path 25 + 130 = 155 is hidden behind 705 (130 hidden): 817.
      Token 1, layer 0: the host path 1229 + 230 = 1459 against the fast path's 1289 (170
      exposed, 60 hidden); layer 1: dense -> 1479, fetches 1479-2079, experts -> 2179. Token 1 =
      1362."""
    r = price(TWO_TOKENS, 1, replace(units(concurrent), host_step_s=30.0))
    assert r.token_s.tolist() == token_s
    assert (r.parts["host_exposed"], r.hidden_host_s) == (host_exposed, hidden)
    assert r.parts["admit_wait"] == admit_wait
    assert sum(r.parts.values()) == r.token_s.sum()


@pytest.mark.parametrize("price", PRICERS)
@pytest.mark.parametrize(
    ("drag", "prefetch_wait", "read_drag"), [(0.0, 1058.0, 0.0), (1.0, 916.0, 142.0)]
)
def test_late_prefetches_are_waited_for(price, drag, prefetch_wait, read_drag):
    """One token, no overhead. Layer 0's prefetch (1 copy) is queued at the token's start:
    link 0-300; after layer 0's dense work (-> 20) layer 1's 3 prefetch copies queue: 300-1200.
    Layer 0 waits 280 for its copy, installs (-> 302), computes 10 experts (-> 402); layer 1:
    dense -> 422, waits 778 for its copies (-> 1200), installs 3 (-> 1206), 10 experts -> 1306.
    With the host reading the copies (the disk tier) and its work at half speed meanwhile
    (background_read_drag 1): layer 0's dense work takes 40, its install 4 (300-304) and its experts
    200 (-> 504), all inside the link's reads; layer 1's dense work 40 (-> 544), it waits 656
    for its copies; past 1200 nothing is read: 1206, 1306. The waits absorb the 142 seconds of
    drag (1058 - 916)."""
    u = UnitCosts(300.0, 10.0, 50.0, 20.0, 0.0, 2.0, True)
    counts = np.array([[token_layer(hit=10, prefetched=1), token_layer(hit=10, prefetched=3)]])
    r = price(counts, 1, replace(u, host_reads_link=True, background_read_drag=drag))
    assert r.token_s.tolist() == [1306.0]
    assert (r.parts["prefetch_wait"], r.parts["read_drag"]) == (prefetch_wait, read_drag)
    assert sum(r.parts.values()) == r.token_s.sum()
    # copies the host does not read (a DMA engine's) leave its work at full speed
    r = price(counts, 1, replace(u, background_read_drag=drag))
    assert (r.parts["prefetch_wait"], r.parts["read_drag"]) == (1058.0, 0.0)


@pytest.mark.parametrize("price", PRICERS)
def test_a_batch_of_background_copies_starts_the_idle_lane_once(price):
    """copy 100, dense 20, expert 10, start 7, one layer of 10 hits, delay 1 (nothing lands).
    token 0: dense -> 20; its 2 requests find no background copy on the link: start 7, once
    for the batch; copies 20-220; experts 27-127. token 1: dense -> 147; its request queues
    behind them (220-320): no start; experts -> 247. token 2 requests nothing: 267, 367.
    token 3: dense -> 387, past 320: its request starts the lane again, 387 + 7 + 100 = 494."""
    u = UnitCosts(100.0, 10.0, 50.0, 20.0, 0.0, 0.0, False, background_start_s=7.0)
    counts = np.array([[token_layer(hit=10, admission_requests=n)] for n in (2, 1, 0, 1)])
    r = price(counts, 1, u)
    assert r.token_s.tolist() == [127.0, 120.0, 120.0, 127.0]
    assert (r.parts["background_start"], r.parts["fast_compute"]) == (14.0, 400.0)
    assert sum(r.parts.values()) == r.token_s.sum()
    # a layer's prefetches are a batch too, started where the engine issues them: layer 1's
    # copy after layer 0's dense work (20), the start 20-27, the copy 20-120; layer 0's experts
    # 27-127; layer 1: dense -> 147, its copy landed, install 2 -> 149, experts -> 249
    two = np.array([[token_layer(hit=10), token_layer(hit=10, prefetched=1)]])
    r = price(two, 1, replace(u, install_s=2.0))
    assert r.token_s.tolist() == [249.0]
    assert r.parts["background_start"] == 7.0


@pytest.mark.parametrize("price", PRICERS)
def test_admissions_land_delay_tokens_after_their_request(price):
    """delay 3: a request at token 0 lands at token 3. Its copy runs 20-1020 (queued at token
    0's decision, 20); tokens of 20 each put token 3's step 1 at 80: it waits 940."""
    u = UnitCosts(1000.0, 10.0, 50.0, 20.0, 0.0, 0.0, True)
    counts = np.zeros((4, 1, len(TOKEN_LAYER_FIELDS)), np.int64)
    counts[0, 0, TOKEN_LAYER_FIELDS.index("admission_requests")] = 1
    counts[3, 0, TOKEN_LAYER_FIELDS.index("admissions")] = 1
    r = price(counts, 3, u)
    assert r.token_s.tolist() == [20.0, 20.0, 20.0, 20.0 + 1020.0 - 80.0]


def test_streams_restart_the_link():
    a, b = TWO_TOKENS, TWO_TOKENS[::-1].copy()
    u = units(concurrent=True)
    pooled = price_streams([a, b], 1, u)
    alone = [price_stream(a, 1, u), price_stream(b, 1, u)]
    assert pooled.token_s.tolist() == [*alone[0].token_s, *alone[1].token_s]
    assert pooled.parts == {p: alone[0].parts[p] + alone[1].parts[p] for p in BREAKDOWN}


@pytest.mark.parametrize("price", PRICERS)
def test_bad_counts_are_named(price):
    u = units(concurrent=True)
    with pytest.raises(ValueError, match="shape"):
        price(np.zeros((2, 3, 5), np.int32), 1, u)
    with pytest.raises(ValueError, match="integer"):
        price(np.zeros((2, 3, len(TOKEN_LAYER_FIELDS))), 1, u)
    with pytest.raises(ValueError, match="delay"):
        price(TWO_TOKENS, 0, u)
    bad = TWO_TOKENS.copy()
    bad[1, 1, 2] = -1
    with pytest.raises(ValueError, match="negative count at token 1, layer 1"):
        price(bad, 1, u)


def test_other_integer_dtypes_are_priced_alike():
    u = units(concurrent=False)
    a = price_stream(TWO_TOKENS.astype(np.uint8), 1, u)
    b = price_stream(TWO_TOKENS, 1, u)
    assert a.token_s.tolist() == b.token_s.tolist()


# a host that computes from its own reads over the link (the disk tier), uploading what it
# computed (llama.cpp PR #27861's --moe-expert-cache-inserts): one layer, delay 1
HOST_UPLOADS = np.array(
    [
        [token_layer(hit=8, host=2, admission_requests=2)],  # token 0: 2 uploads requested
        [token_layer(hit=8, host=2, admissions=2)],  # token 1: they land
    ],
    dtype=np.int32,
)


@pytest.mark.parametrize("price", PRICERS)
@pytest.mark.parametrize(
    ("drags", "concurrent", "token_s", "host_exposed", "read_drag", "hidden"),
    [
        ((0.0, 0.0), False, [205.0, 209.0], 200.0, 0.0, 0.0),
        ((0.0, 0.0), True, [185.0, 189.0], 160.0, 0.0, 40.0),
        ((1.0, 0.0), False, [235.0, 239.0], 200.0, 60.0, 0.0),
        ((1.0, 0.0), True, [185.0, 189.0], 100.0, 60.0, 100.0),
        ((0.0, 1.0), False, [235.0, 209.0], 200.0, 30.0, 0.0),
        ((0.0, 1.0), True, [185.0, 189.0], 140.0, 20.0, 60.0),
        ((1.0, 1.0), False, [265.0, 239.0], 200.0, 90.0, 0.0),
        ((1.0, 1.0), True, [185.0, 189.0], 70.0, 90.0, 130.0),
    ],
)
def test_host_reads_go_ahead_of_the_uploads(
    price, drags, concurrent, token_s, host_exposed, read_drag, hidden
):
    """copy 30, expert 10, host expert 50 (its compute: the read is a copy on the link), dense
    20, overhead 5, install 2; the host reads over the link, and the engine starts a decision's
    uploads once the host's reads are done.

    token 0: overhead -> 5, dense -> 25; the decision at 25 queues the host's 2 reads (link
      25-85), then the 2 uploads behind them (link 85-145). Fast path 25 + 8 x 10 = 105.
      one processor: the host computes after the fast path and its reads: max(105, 85) + 100
        = 205. concurrent: max(105, 85 + 100) = 185, 20 of the host's compute hidden.
    token 1 (from 205): overhead, dense (230), the uploads landed at 145 (no wait), 2 installs:
      the decision at 234; the link is free, the reads take 234-294; fast path 234 + 80 = 314.
      one processor: max(314, 294) + 100 = 414, a token of 209 (the reads hidden behind the
      fast path). concurrent (from 185, the decision at 214): max(294, 274 + 100) = 374, a
      token of 189, 20 hidden.
    With the fast tier at half speed while the host reads its experts (host_read_drag 1):
      token 0's first 30 take the reads (25-85), its last 50 follow: 135 (30 of drag); one
      processor: 135 + 100 = 235, concurrent: max(135, 185) = 185 (50 hidden). Token 1 the same
      way: 264 + 30 -> 324, its last 50 to 374: 474, a token of 239; concurrent 214 -> 324,
      max(324, 374): 189 (50 hidden).
    At half speed while the uploads are read (background_read_drag 1): token 0's first 60 run
      to 85 at full speed, its last 20 inside the uploads' reads: 125 (20 of drag). One
      processor: the host computes on it from 125, its first 10 inside the uploads' reads (to
      145, 10 more of drag), its last 90 after: 235. Concurrent: 185 (40 hidden). Token 1
      reads no upload: 209, or 189 (20 hidden).
    Both: token 0's first 30 take the host's reads, the next 30 the uploads' (85-145), the last
      20 follow: 165 (60 of drag). one processor: the uploads are read by then: 265, then the
      reads 294-354 and the fast path to 404: 504, a token of 239. concurrent: max(165, 185) =
      185 (80 hidden), then as with the host's drag alone.
    The drag is its own part (read_drag), the host's included; the host's own time past the
    dragged fast path is host_exposed.
    Without the link the host computes from the decision on (no reads, nothing to drag): 205
    and 125 for token 0, then 209 and 129."""
    host_drag, background_drag = drags
    u = replace(
        units(concurrent, copy_s=30.0), host_reads_link=True, host_read_drag=host_drag,
        background_read_drag=background_drag,
    )  # fmt: skip
    r = price(HOST_UPLOADS, 1, u)
    assert r.token_s.tolist() == token_s
    assert (r.parts["link_wait"], r.parts["fast_compute"]) == (0.0, 160.0)
    assert (r.parts["host_exposed"], r.parts["read_drag"], r.hidden_host_s) == (
        host_exposed, read_drag, hidden,
    )  # fmt: skip
    assert sum(r.parts.values()) == r.token_s.sum()
    own_memory = price(HOST_UPLOADS, 1, replace(u, host_reads_link=False))
    assert own_memory.token_s.tolist() == ([205.0, 209.0] if not concurrent else [125.0, 129.0])


@pytest.mark.parametrize("price", PRICERS)
@pytest.mark.parametrize(
    ("concurrent", "background_drag", "token_s", "host_exposed", "read_drag", "hidden"),
    [
        (False, 0.0, [205.0, 209.0], 200.0, 0.0, 0.0),
        (True, 0.0, [165.0, 169.0], 120.0, 0.0, 80.0),
        (False, 1.0, [235.0, 209.0], 200.0, 30.0, 0.0),
    ],
)
def test_the_hosts_reads_take_their_own_time_and_the_uploads_a_copys(
    price, concurrent, background_drag, token_s, host_exposed, read_drag, hidden
):
    """The uploads example with the host's reads at 20 each (`host_read_s`: they come back to
    back) and every copy at 30.

    token 0: the decision at 25 queues the host's 2 reads (link 25-65), then the 2 uploads (65-
      125). Fast path 25 + 80 = 105. One processor: max(105, 65) + 100 = 205. Concurrent: max(105,
      65 + 100) = 165, 40 of the host's compute hidden (105 - 65).
    token 1: one processor (from 205) as before: 209. Concurrent (from 165): overhead, dense
      (190), the uploads landed at 125, 2 installs: the decision at 194; the reads take 194-234;
      fast path 274; max(274, 234 + 100) = 334, a token of 169, 40 hidden.
    At half speed while the uploads are read (background_read_drag 1, one processor): token 0's
      first 40 run to 65, the uploads' reads (65-125, at a copy's 30 each: at 20 they would end
      at 105) hold 30 of its work, its last 10 follow: 135 (30 of drag); the host computes after
      the uploads: 235. Token 1 reads no upload: 209."""
    u = replace(
        units(concurrent, copy_s=30.0), host_reads_link=True, host_read_s=20.0,
        background_read_drag=background_drag,
    )  # fmt: skip
    r = price(HOST_UPLOADS, 1, u)
    assert r.token_s.tolist() == token_s
    assert (r.parts["host_exposed"], r.parts["read_drag"], r.hidden_host_s) == (
        host_exposed, read_drag, hidden,
    )  # fmt: skip
    assert sum(r.parts.values()) == r.token_s.sum()
    # unset, the host's reads are copies (the example above)
    assert replace(u, host_read_s=None).host_read_each_s == 30.0


def test_the_reference_records_each_blocks_timeline():
    """The example above on one processor, without drags: token 0's block decides at 25, its
    fast path ends at 105, the host's reads at 85, the layer at 205; token 1's at 234, 314,
    294 and 414 (the reads hidden behind the fast path)."""
    blocks: list[LayerBlock] = []
    u = replace(units(False, copy_s=30.0), host_reads_link=True)
    r = price_stream_reference(HOST_UPLOADS, 1, u, blocks)
    assert blocks == [LayerBlock(25.0, 105.0, 85.0, 205.0), LayerBlock(234.0, 314.0, 294.0, 414.0)]
    assert r.token_s.tolist() == price_stream_reference(HOST_UPLOADS, 1, u).token_s.tolist()


seconds = st.floats(0.0, 1e-3, allow_nan=False, allow_infinity=False)


@st.composite
def priced_streams(draw):
    T, L = draw(st.integers(0, 7)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    counts = draw(hnp.arrays(dtype, (T, L, len(TOKEN_LAYER_FIELDS)), elements=st.integers(0, 6)))
    u = UnitCosts(
        *(draw(seconds) for _ in range(6)),
        concurrent_host=draw(st.booleans()),
        host_reads_link=draw(st.booleans()),
        host_read_drag=draw(st.just(0.0) | st.floats(0.0, 2.0)),
        background_read_drag=draw(st.just(0.0) | st.floats(0.0, 2.0)),
        sync_step_s=draw(st.just(0.0) | seconds),
        host_read_s=draw(st.none() | seconds),
        host_step_s=draw(st.just(0.0) | seconds),
        background_start_s=draw(st.just(0.0) | seconds),
    )
    return counts, draw(st.integers(1, 5)), u


@settings(max_examples=300, deadline=None)
@given(priced_streams())
def test_the_core_equals_the_reference_bit_for_bit(case):
    counts, delay, u = case
    blocks: list[LayerBlock] = []
    fast, ref = price_stream(counts, delay, u), price_stream_reference(counts, delay, u, blocks)
    np.testing.assert_array_equal(fast.token_s, ref.token_s)
    # one block per token-layer, in order; a token ends with its last layer's block
    T, L = counts.shape[:2]
    assert len(blocks) == T * L
    assert all(b.decided <= b.fast_done <= b.end and b.host_ready <= b.end for b in blocks)
    ends = [blocks[(t + 1) * L - 1].end for t in range(T)]
    np.testing.assert_allclose(np.diff([0.0, *ends]), ref.token_s, rtol=1e-12, atol=1e-15)
    assert fast.parts == ref.parts
    assert fast.hidden_host_s == ref.hidden_host_s
    assert sum(fast.parts.values()) == pytest.approx(fast.token_s.sum(), rel=1e-12, abs=1e-15)
    if not u.concurrent_host:
        assert fast.hidden_host_s == 0.0
