"""Pinning and allocation designs on the evaluation and the skew-matched trace: the analysis's
comparison of each design with its counterpart."""

from __future__ import annotations

import polars as pl
import pytest

from moesub.stats.regime import WORLDS, design_comparison


def _rows(design: str, change: str, counterpart: str, hits: dict, misses: dict) -> list[dict]:
    """Long rows as the regime stage writes them: (world, role) -> hit rate, misses."""
    return [
        {
            "world": world,
            "design": design,
            "role": role,
            "change": change,
            "counterpart": counterpart,
            "size": "f0.25",
            "capacity": 128,
            "capacities": "128",
            "pins": "64",
            "hit_rate": hits[world, role],
            "misses_per_token": misses[world, role],
            "fetches_per_token": misses[world, role],
        }
        for world in WORLDS
        for role in ("design", "counterpart")
    ]


def test_comparison_by_hand():
    hits = {
        ("evaluation", "design"): 0.87,
        ("evaluation", "counterpart"): 0.82,
        ("skew_matched", "design"): 0.80,
        ("skew_matched", "counterpart"): 0.79,
    }
    misses = {k: 40 * (1 - v) for k, v in hits.items()}  # L x k = 40 calls per token
    table = pl.DataFrame(_rows("fitz_tec_pins", "pins 50%", "no pins", hits, misses))
    row = design_comparison(table).row(0, named=True)
    assert row["gain_evaluation"] == pytest.approx(0.05)
    assert row["gain_skew_matched"] == pytest.approx(0.01)
    assert row["gain_change"] == pytest.approx(-0.04)
    assert row["miss_change_evaluation"] == pytest.approx(-2.0)
    assert row["miss_change_skew_matched"] == pytest.approx(-0.4)
    assert row["counterpart_hit_rate_skew_matched"] == 0.79
    assert row["capacities_evaluation"] == "128"
