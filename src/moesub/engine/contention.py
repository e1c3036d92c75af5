"""How much of the machine a timed engine run had: its CPU share, and a flag when it was shared.

An engine, calibration or benchmark job runs with every core of the run (Snakemake `threads:
ALL_CORES`), so no other job of the pipeline runs beside it; other processes on the machine
still can. `CpuMeter` measures, over a run, the process's time on a CPU and the time its
threads were runnable but waiting for one (Linux `/proc/self/task/*/schedstat`):
`cpu_share = on CPU / (on CPU + waiting for a CPU)`. A run below `CONTENDED_BELOW` is flagged
`contended`: its times are slower than the machine's. Time blocked on I/O (the disk tier's
reads) is neither, so a quiet run that waits for the disk keeps its share near 1, and the share
does not depend on how many threads the run has. `cpu_time_per_wall` (process CPU time / wall)
is recorded beside it. Without schedstat (not Linux), the share is CPU time / wall.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

CONTENDED_BELOW = 0.8  # a run that had less of the CPU it wanted is flagged "contended"
_TASKS = Path("/proc/self/task")


def _schedstat() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable and waiting) summed over the process's threads."""
    if not _TASKS.is_dir():
        return None
    on = wait = 0
    for task in _TASKS.iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        on, wait = on + int(fields[0]), wait + int(fields[1])
    return on * 1e-9, wait * 1e-9


class CpuMeter:
    """CPU share of the process over one or more intervals, each from `start()` to `pause()`
    (a stage that interleaves several runs meters each over its own stretches); `stop()` ends
    the last one and sums them (module doc)."""

    def __init__(self) -> None:
        self._wall = self._cpu = self._on = self._wait = 0.0
        self._sched_ok = True
        self._load: tuple[float, float, float] | None = None
        self._marks: tuple[float, float, tuple[float, float] | None] | None = None  # running

    def start(self) -> CpuMeter:
        self._marks = (time.perf_counter(), time.process_time(), _schedstat())
        if self._load is None:
            self._load = os.getloadavg()
        return self

    def pause(self) -> None:
        """End the running interval (none running: nothing to add)."""
        if self._marks is None:
            return
        (wall0, cpu0, sched0), self._marks = self._marks, None
        self._wall += time.perf_counter() - wall0
        self._cpu += time.process_time() - cpu0
        sched = _schedstat()
        if sched0 is None or sched is None:
            self._sched_ok = False
        else:
            self._on += sched[0] - sched0[0]
            self._wait += sched[1] - sched0[1]

    def stop(self) -> dict[str, Any]:
        """`cpu_share`, `contended`, `cpu_time_per_wall`, the load averages at start and end."""
        self.pause()
        wall, cpu = self._wall, self._cpu
        if self._sched_ok:
            on, wait = self._on, self._wait
            share = on / (on + wait) if on + wait > 0 else 1.0
        else:
            share = min(cpu / wall, 1.0) if wall > 0 else 1.0
        return {
            "cpu_share": float(share),
            "contended": bool(share < CONTENDED_BELOW),
            "cpu_time_per_wall": float(cpu / wall) if wall > 0 else float("nan"),
            "load_avg_start": list(self._load),
            "load_avg_end": list(os.getloadavg()),
        }
