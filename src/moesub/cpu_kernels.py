"""Which CPU kernels the pipeline's jobs compute with, so that a fresh clone's figures do not
depend on the processor.

torch picks its vectorized kernels (ATen) and MKL its BLAS path by the processor, and each
path rounds differently: at the same pins the embedded model trained to another held-out
perplexity on an AVX-512 EPYC than on the earlier VMs (docs/measurements.md, "The default run
on another processor"). `cpu_kernels: avx2` (config.yaml) pins both to AVX2, which every x86-64
processor since 2013-2015 has: ATen's AVX2 kernels (`ATEN_CPU_CAPABILITY`) and MKL's AVX2 path
of its conditional numerical reproducibility (`MKL_CBWR`, strict: independent of alignment).
Both are read once, at a process's first kernel, so they are set in the process that starts the
jobs (the Snakefile) and every job inherits them. Bits also depend on the thread count: the
embedded model trains on a fixed number (`embedded.threads`). `native` leaves each processor
its fastest kernels. Elsewhere than x86-64 (Apple and other Arm machines) nothing is pinned."""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping

PINNED = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}, "native": {}}
X86_64 = ("x86_64", "amd64")


def pin_cpu_kernels(
    choice: str, environ: MutableMapping[str, str] = os.environ, machine: str | None = None
) -> dict[str, str]:
    """Set `choice`'s variables in `environ` (over any already there: the config decides) and
    return them; none on a processor other than x86-64 (`machine`: `platform.machine()`)."""
    if choice not in PINNED:
        raise ValueError(f"cpu_kernels: {choice!r} is not one of {sorted(PINNED)}")
    machine = platform.machine() if machine is None else machine
    pinned = PINNED[choice] if machine.lower() in X86_64 else {}
    environ.update(pinned)
    return dict(pinned)


def kernel_facts() -> dict[str, object]:
    """What this process computes with, for a run's summary: torch's kernel capability, the MKL
    branch its environment asks for (`MKL_CBWR`; None: the processor's own) and torch's thread
    count."""
    import torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "torch_threads": torch.get_num_threads(),
    }
