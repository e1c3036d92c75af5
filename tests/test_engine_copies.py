"""moesub.engine.copies: the background copies' ledger on a real disk tier: requests matched to
what lands (purpose and token kept, any purpose), installed only into a slot awaiting that
expert, bytes counted per purpose, the wait and its timeout, and a copy never asked for."""

from __future__ import annotations

import pytest
import torch
from test_engine import ACT
from test_engine_memory import small_store

from moesub.engine import copies as copies_module
from moesub.engine.copies import BackgroundCopies, Copy
from moesub.engine.tiers import DiskTier

E = 8


def test_copies_land_install_into_awaiting_slots_and_count_bytes(tmp_path):
    store, experts = small_store(tmp_path, L=2, E=E)
    tier = DiskTier(store, 3, 2, ACT, staging_buffers=4)
    landed = []
    copies = BackgroundCopies(tier, landed.append)
    try:
        copies.request(0, 5, "admission", 7)
        copies.request(0, 6, "prefetch", 7)
        copies.request(1, 2, "host_admit", 8)  # any cause of a background upload is a purpose
        copies.await_copy(0, 1, 5)
        copies.await_copy(1, 0, 2)
        assert copies.any_awaiting(0, {1, 2}) and not copies.any_awaiting(0, {0, 2})
        waited = copies.wait(lambda: len(landed) < 3, "three copies")
        assert waited >= 0.0 and copies.wait(lambda: False, "nothing") == 0.0
        by_expert = {c.copy.expert: c for c in landed}
        assert {c.copy for c in landed} == {
            Copy(0, 5, "admission", 7), Copy(0, 6, "prefetch", 7), Copy(1, 2, "host_admit", 8),
        }  # fmt: skip
        assert copies.install(by_expert[5], 1)  # slot 1 awaits expert 5: installed
        assert torch.equal(tier.slots[0].gate_up[1], experts[5][0])
        assert torch.equal(tier.slots[0].down[1], experts[5][1])
        assert not copies.any_awaiting(0, {1})
        assert not copies.install(by_expert[6], 2)  # slot 2 awaits nothing: dropped
        copies.filled(1, 0)  # a synchronous fetch filled slot 0 meanwhile
        assert not copies.install(by_expert[2], 0)
        expert_bytes = store.layout.expert_bytes
        assert copies.take_bytes() == {"admission": expert_bytes}
        assert copies.take_bytes()["admission"] == 0  # taken: counted once
        assert tier.reader._free.qsize() == 4  # every staging buffer released
    finally:
        tier.close()


def test_copy_never_asked_for_and_wait_timeout(tmp_path, monkeypatch):
    store, _experts = small_store(tmp_path, L=2, E=E)
    tier = DiskTier(store, 3, 2, ACT, staging_buffers=2)
    copies = BackgroundCopies(tier, lambda landed: None)
    try:
        tier.request(0, 3)  # behind the ledger's back
        with pytest.raises(RuntimeError, match="expert 3 landed that was never asked for"):
            copies.wait(lambda: True, "forever")
        monkeypatch.setattr(copies_module, "COPY_TIMEOUT_S", 0.01)
        with pytest.raises(RuntimeError, match="forever did not land within 0.01 s"):
            copies.wait(lambda: True, "forever")
    finally:
        tier.close()


def test_a_drain_that_cannot_finish_says_why(tmp_path):
    """A read waiting for the only staging buffer, which the caller holds (a landed copy never
    given back), would keep the drain waiting forever: it raises, and drains once it is back."""
    store, _experts = small_store(tmp_path, L=2, E=E)
    tier = DiskTier(store, 3, 2, ACT, staging_buffers=1)
    try:
        tier.request(0, 3)
        tier.request(0, 4)
        held = []
        while not held:
            held = tier.completed(0)
        with pytest.raises(RuntimeError, match="1 expert reads wait for a staging buffer"):
            tier.reader.drain(stall_s=0.2)
        tier.discard(held[0])
        tier.drain()
        assert tier.reader._free.qsize() == 1
    finally:
        tier.close()
