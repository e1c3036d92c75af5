"""How much of the machine a timed engine run had: its CPU share, what other processes used
beside it, and a flag when it was shared.

An engine, calibration or benchmark job runs with every core of the run (Snakemake `threads:
ALL_CORES`), so no other job of the pipeline runs beside it; other processes on the machine
still can. `CpuMeter` measures, over a run, the process's time on a CPU and the time its
threads were runnable but waiting for one (Linux `/proc/self/task/*/schedstat`):
`cpu_share = on CPU / (on CPU + waiting for a CPU)`. Time blocked on I/O (the disk tier's
reads) is neither, so a quiet run that waits for the disk keeps its share near 1, and the share
does not depend on how many threads the run has. Beside it, from the machine's counters
(`/proc/stat`): `other_cores`, the cores kept busy by anything else on average over the run (the
machine's busy time less the process's own CPU time, plus the time a virtual machine's host ran
something else instead of its CPUs, per second of wall time), and `steal_cores`, the host's part
of it. The share alone can miss another job: the default run of 2026-12-04 ran its engine stage
at a load average of 3.2 on the 2-core machine with shares of 0.82-0.91, unflagged, and its
times per token were 10-44% above the same stage's, run alone two hours later (shares
0.91-1.00). One process spinning beside a 2-thread engine run made it 3-4 times slower (share
0.60-0.63, others 0.74-0.78 cores: benchmarks/bench_contention.py,
docs/measurements.md). A run is flagged `contended` (its times are slower than the machine's)
when its share is below `CONTENDED_BELOW` or `other_cores` is above `SHARED_ABOVE`
(`moesub.hardware.is_contended`, which the report states).
`cpu_time_per_wall` (process CPU time / wall) is recorded beside them. Without schedstat (not
Linux), the share is CPU time / wall; without `/proc/stat` the others are not known (NaN) and
only the share flags a run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moesub.hardware import is_contended

_TASKS = Path("/proc/self/task")
_STAT = Path("/proc/stat")


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


def _machine_busy() -> tuple[float, float] | None:
    """(seconds the machine's CPUs were busy, seconds stolen by a VM's host), summed over its
    CPUs since boot (`/proc/stat`'s first line: user nice system idle iowait irq softirq steal
    ...; guest time is inside user)."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _add(
    total: list[float] | None, before: Sequence[float] | None, after: Sequence[float] | None
) -> list[float] | None:
    """`total` + (`after` - `before`), element by element; None once a reading is missing."""
    if total is None or before is None or after is None:
        return None
    return [t + a - b for t, a, b in zip(total, after, before, strict=True)]


class CpuMeter:
    """CPU share of the process over one or more intervals, each from `start()` to `pause()`
    (a stage that interleaves several runs meters each over its own stretches); `stop()` ends
    the last one and sums them (module doc)."""

    def __init__(self) -> None:
        self._wall = self._cpu = 0.0
        # summed over the intervals: schedstat's (on CPU, waiting), the machine's (busy, steal)
        self._sched: list[float] | None = [0.0, 0.0]
        self._machine: list[float] | None = [0.0, 0.0]
        self._load: tuple[float, float, float] | None = None
        self._marks: tuple | None = None  # (wall, cpu, schedstat, machine) while running

    def start(self) -> CpuMeter:
        self._marks = (time.perf_counter(), time.process_time(), _schedstat(), _machine_busy())
        if self._load is None:
            self._load = os.getloadavg()
        return self

    def pause(self) -> None:
        """End the running interval (none running: nothing to add)."""
        if self._marks is None:
            return
        (wall0, cpu0, sched0, machine0), self._marks = self._marks, None
        self._wall += time.perf_counter() - wall0
        self._cpu += time.process_time() - cpu0
        self._machine = _add(self._machine, machine0, _machine_busy())
        self._sched = _add(self._sched, sched0, _schedstat())

    def stop(self) -> dict[str, Any]:
        """`cpu_share`, `other_cores`, `steal_cores`, `contended`, `cpu_time_per_wall`, the load
        averages at start and end."""
        self.pause()
        wall, cpu = self._wall, self._cpu
        others = steal = float("nan")
        if self._machine is not None and wall > 0:
            # the machine's counters tick at 1/SC_CLK_TCK: a short run's own time may exceed
            # them by a tick or two
            busy, stolen = self._machine
            steal = stolen / wall
            others = max(busy - cpu, 0.0) / wall + steal
        if self._sched is not None:
            on, wait = self._sched
            share = on / (on + wait) if on + wait > 0 else 1.0
        else:
            share = min(cpu / wall, 1.0) if wall > 0 else 1.0
        return {
            "cpu_share": float(share),
            "other_cores": float(others),
            "steal_cores": float(steal),
            "contended": is_contended(share, others),
            "cpu_time_per_wall": float(cpu / wall) if wall > 0 else float("nan"),
            "load_avg_start": list(self._load),
            "load_avg_end": list(os.getloadavg()),
        }
