"""Atomic artefact writers: every stage writes to a temp file (or directory) beside the target,
then renames.

An interrupted job therefore never leaves a half-written Parquet file that a later stage (or a
Snakemake rerun) could mistake for a finished one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path in the target's directory; rename it onto `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    tmp.chmod(0o666 & ~_UMASK)  # mkstemp makes 0600; artefacts get the usual umask permissions
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp dir beside `out_dir`; it replaces `out_dir` only on success."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / "prev")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        out.chmod(0o777 & ~_UMASK)  # mkdtemp makes 0700; directories get the usual umask
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _table(data: Any, metadata: dict[str, Any] | None) -> pa.Table:
    if isinstance(data, pa.Table):
        table = data
    elif hasattr(data, "to_arrow"):  # polars
        table = data.to_arrow()
    elif hasattr(data, "columns") and hasattr(data, "to_dict"):  # pandas
        table = pa.Table.from_pandas(data, preserve_index=False)
    else:
        table = pa.table(data)
    if metadata:
        meta = dict(table.schema.metadata or {})
        meta.update({k.encode(): json.dumps(v).encode() for k, v in metadata.items()})
        table = table.replace_schema_metadata(meta)
    return table


def write_parquet(
    data: Any, path: str | os.PathLike, metadata: dict[str, Any] | None = None
) -> Path:
    """Write a table (pyarrow / polars / pandas / dict of columns) atomically.

    `metadata` values are JSON-encoded into the Parquet schema metadata (read back with
    `read_metadata`).
    """
    table = _table(data, metadata)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


class AtomicWriter:
    """Base of writers whose file appears (atomically) on close: `_tmp` is the temp path to
    write; a subclass closes its own handle in `_close_output`. `abort` (or leaving a `with`
    block by an exception) leaves nothing."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._ctx = atomic_path(self.path)
        self._tmp = self._ctx.__enter__()

    def _close_output(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._close_output()
        self._ctx.__exit__(None, None, None)

    def abort(self) -> None:
        self._close_output()
        with contextlib.suppress(BaseException):
            self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ParquetStreamWriter(AtomicWriter):
    """Writes a large table one row group at a time; the file appears (atomically) on close.

    `metadata` is JSON-encoded like `write_parquet`'s; `writer_options` go to
    `pyarrow.parquet.ParquetWriter` (per-column dictionary encoding, compression).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        schema: pa.Schema,
        metadata: Mapping[str, Any] | None = None,
        **writer_options: Any,
    ):
        if metadata:
            meta = {k.encode(): json.dumps(v).encode() for k, v in metadata.items()}
            schema = schema.with_metadata(meta)
        self.schema = schema
        super().__init__(path)
        self._writer = pq.ParquetWriter(self._tmp, schema, **writer_options)

    def write_table(self, table: pa.Table) -> None:
        """One row group (or more, for a large table)."""
        if not table.schema.equals(self.schema, check_metadata=False):
            table = table.cast(self.schema)
        self._writer.write_table(table)

    def _close_output(self) -> None:
        self._writer.close()


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON-decoded key/value metadata written by `write_parquet` / `ParquetStreamWriter`."""
    meta = pq.read_schema(path).metadata or {}
    out = {}
    for k, v in meta.items():
        key = k.decode()
        if key == "pandas" or key.startswith("ARROW"):
            continue
        try:
            out[key] = json.loads(v)
        except ValueError:
            out[key] = v.decode()
    return out


def require_file(path: str | os.PathLike, arg: str) -> Path:
    """`path` as a Path; FileNotFoundError naming the argument `arg` when it does not exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{arg}: {str(path)!r} does not exist")
    return path


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=float) + "\n")
    return Path(path)
