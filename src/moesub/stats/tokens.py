"""One model's per-token artefacts in DuckDB: `load_tokens` -> `Tokens` (tables `cap`, `emu`,
`emu_base`), which the parts that need tokens query; `register_files` joins a kind's file keys
(policy name, fraction, ...) to its rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import pandas as pd

from moesub.policy import STATUS_NAMES
from moesub.stats.load import FileInfo, sql_list


def register_files(db: duckdb.DuckDBPyConnection, kind: str, infos: list[FileInfo]) -> str:
    """Registers the files' keys (filename, name, fraction, ...) as the view `files_<kind>`,
    to join with `read_parquet(..., filename=true)`; returns the view's name."""
    rows = [
        {
            "filename": i.path,
            "name": i.name,
            "fraction": i.fraction,
            "device": i.device,
            "condition": i.condition,
            "target_mass": i.target_mass,
            "num_layers": i.num_layers,
        }
        for i in infos
    ]
    table = f"files_{kind}"
    db.register(table, pd.DataFrame(rows))
    return table


@dataclass(frozen=True)
class Tokens:
    """One model's per-token tables in the DuckDB connection `db` (`load_tokens`).

    `cap(stream, pos, doc_id, doc_start, nll)`: the captured exact model, when `captured`;
    `emu(name, fraction, stream, pos, doc_id, doc_start, nll, mass, <STATUS_NAMES>)`: every
    emulated policy (mass per token-layer) and `emu_base(fraction, stream, pos, nll_b)`: the
    baseline's NLL at each fraction, when `emulated`; `dppl_base`: fraction -> what Δppl is
    taken against there (the baseline emulated, the captured NLL, or none).
    """

    db: duckdb.DuckDBPyConnection
    captured: bool
    emulated: bool
    dppl_base: dict[str, str] = field(default_factory=dict)


def load_tokens(
    db: duckdb.DuckDBPyConnection, capture: list[str], emulate: list[FileInfo], baseline: str
) -> Tokens:
    """The token tables of `Tokens` from the capture paths and the emulate files into `db`."""
    if capture:
        db.execute(
            "CREATE TEMP TABLE cap AS SELECT stream, pos, doc_id, doc_start, nll "
            f"FROM read_parquet({sql_list(capture)})"
        ).fetchall()
        dup = db.execute("SELECT count(*) - count(DISTINCT (stream, pos)) FROM cap").fetchall()
        if dup[0][0]:
            raise ValueError(
                f"inputs['capture_tokens']: {dup[0][0]} duplicate (stream, pos) rows across "
                f"{capture}: pass one split of one model"
            )
    if not emulate:
        return Tokens(db, captured=bool(capture), emulated=False)
    files = register_files(db, "emulate", emulate)
    # one mass unit: emulate's `mass` is the sum over the L layers; per token-layer here
    # (L from the metadata, else the length of layer_mass; file_info checked one exists)
    layers = "CAST(f.num_layers AS DOUBLE)"
    if any(i.num_layers is None for i in emulate):
        layers = f"coalesce({layers}, len(t.layer_mass))"
    counts = ", ".join(f't."{name}"' for name in STATUS_NAMES)
    db.execute(
        "CREATE TEMP TABLE emu AS SELECT f.name, f.fraction, t.stream, t.pos, t.doc_id, "
        f"t.doc_start, t.nll, t.mass / {layers} AS mass, {counts} "
        f"FROM read_parquet({sql_list([i.path for i in emulate])}, filename=true, "
        f"union_by_name=true) t JOIN {files} f USING (filename)"
    ).fetchall()
    dppl_base = _emulate_baseline(db, bool(capture), baseline)
    return Tokens(db, captured=bool(capture), emulated=True, dppl_base=dppl_base)


def _emulate_baseline(db: duckdb.DuckDBPyConnection, captured: bool, base: str) -> dict[str, str]:
    """Fills emu_base(fraction, stream, pos, nll_b): the baseline's NLL at every fraction (the
    captured NLL where the baseline was not emulated); returns fraction -> its source."""
    db.execute(
        "CREATE TEMP TABLE emu_base AS SELECT fraction, stream, pos, nll AS nll_b "
        "FROM emu WHERE name = ?",
        [base],
    ).fetchall()
    fractions = [r[0] for r in db.execute("SELECT DISTINCT fraction FROM emu").fetchall()]
    have = {r[0] for r in db.execute("SELECT DISTINCT fraction FROM emu_base").fetchall()}
    sources = {}
    for frac in sorted(fractions):
        if frac in have:
            sources[str(frac)] = f"{base} (emulated)"
        elif captured:
            db.execute(
                "INSERT INTO emu_base SELECT ?, stream, pos, nll FROM cap", [frac]
            ).fetchall()
            sources[str(frac)] = "captured exact NLL"
        else:
            sources[str(frac)] = "none"
    return sources
