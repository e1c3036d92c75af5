"""The pinned CPU kernels (moesub.cpu_kernels): the variables set, and the same bits with and
without the processor's AVX-512."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_embedded import TINY

from moesub.cpu_kernels import PINNED, pin_cpu_kernels

# A few training steps of a test-size embedded model (argv: its params), as build_model trains
# it, then a digest of every weight: the bits that the kernels round.
TRAIN_AND_DIGEST = """
import hashlib, json, sys, types
import numpy as np, torch
from transformers import Qwen3NextForCausalLM
from moesub.embedded.config import EmbeddedConfig, model_config
from moesub.embedded.training import train
cfg = EmbeddedConfig.from_params(json.loads(sys.argv[1]))
torch.set_num_threads(cfg.threads)
torch.use_deterministic_algorithms(True)
torch.manual_seed(cfg.seed)
ids = types.SimpleNamespace(bos_token_id=0, eos_token_id=1, pad_token_id=1)
model = Qwen3NextForCausalLM(model_config(cfg, ids))
train(model, np.random.default_rng(0).integers(0, cfg.vocab_size, 20000).astype(np.int32), cfg)
digest = hashlib.sha256()
for name, p in sorted(model.state_dict().items()):
    digest.update(p.detach().numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), digest.hexdigest())
"""
FOUR_STEPS = {**TINY, "vocab_size": 300, "warmup_steps": 2, "max_tokens": 64 * 4 * 4, "threads": 2}


def test_avx2_pins_atens_and_mkls_kernels_over_what_the_environment_had():
    env = {"ATEN_CPU_CAPABILITY": "avx512", "PATH": "/bin"}
    assert pin_cpu_kernels("avx2", env, machine="x86_64") == PINNED["avx2"]
    assert env == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "PATH": "/bin"}


@pytest.mark.parametrize(("choice", "machine"), [("native", "x86_64"), ("avx2", "arm64")])
def test_native_kernels_and_other_processors_leave_the_environment(choice, machine):
    env = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert pin_cpu_kernels(choice, env, machine=machine) == {}
    assert env == {"ATEN_CPU_CAPABILITY": "avx512"}


def test_unknown_kernels_name_the_key():
    with pytest.raises(ValueError, match=r"cpu_kernels: 'avx512' is not one of \['avx2', 'nat"):
        pin_cpu_kernels("avx512", {})


def _has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or not _has_avx512()
    or not torch.backends.mkl.is_available(),
    reason="needs an x86-64 processor with AVX-512 and torch with MKL",
)
def test_pinned_kernels_train_the_same_bits_with_and_without_avx512():
    def trained(**variables: str) -> tuple[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
        out = subprocess.run(
            [sys.executable, "-c", TRAIN_AND_DIGEST, json.dumps(FOUR_STEPS)],
            env={**env, **variables},
            capture_output=True, text=True, check=True, timeout=300,
        )  # fmt: skip
        capability, digest = out.stdout.split()[-2:]
        return capability, digest

    pinned = dict(PINNED["avx2"])
    native = trained()
    here = trained(**pinned)
    # a processor without AVX-512: torch's kernels at AVX2 (pinned anyway), MKL's limited to it
    without_avx512 = trained(**pinned, MKL_ENABLE_INSTRUCTIONS="AVX2")
    assert native[0] == "AVX512" and here[0] == without_avx512[0] == "AVX2"
    assert here[1] == without_avx512[1]
    assert native[1] != here[1]  # the pin changed the kernels this processor computes with
