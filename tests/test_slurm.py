"""The pipeline on a real SLURM cluster: the test config through `--profile profiles/slurm`.

`scripts/slurm_cluster.sh` installs (Debian packages) and starts a single-node cluster with a
`cpu` and a `gpu` partition (fake GPU GRES). The test asserts that every job of the DAG was a
SLURM job (job ids from the plugin's logs, looked up with `scontrol show job`), that they ran
and completed, and that the engine jobs ran on the `gpu` partition holding the GPU.

Skipped (with the reason) only where SLURM cannot be installed or started; with `CI=true` in
the environment that is a failure instead.

A stopped cluster leaves no config behind (a config naming a controller that is down makes every
`snakemake` start wait ~10 s): checked in a private mount namespace, without a cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest
from test_workflow import BIN, REPO, copy_workflow, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
# The profile's per-rule threads are sized for cluster nodes; this node has `nproc` CPUs.
THREADS = ["model_embedded=2", "capture=1", "engine=1", "engine_bench=1"]
GPU_RULES = {"engine", "engine_bench"}  # profiles/slurm: slurm_partition gpu, gpu 1


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"SLURM is required in CI but unavailable: {reason}")
    pytest.skip(f"SLURM unavailable: {reason}")


@pytest.fixture(scope="module")
def cluster():
    """A running cluster (started here unless one already answers); stopped if started here."""
    if shutil.which("sinfo") and _status() == 0:
        yield
        return
    if os.geteuid() != 0:
        _unavailable("not root: cannot install or start slurmctld/slurmd/munged")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        _unavailable("no apt-get to install slurmctld, slurmd, slurm-client and munge")
    up = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        _unavailable(f"scripts/slurm_cluster.sh up failed:\n{up.stdout}\n{up.stderr}")
    yield
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


def _status() -> int:
    return subprocess.run(
        ["bash", str(CLUSTER), "status"], capture_output=True, timeout=30
    ).returncode


def _scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, f"scontrol show job {job_id}: {out.stderr}"
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def test_partitions(cluster):
    out = subprocess.run(
        ["sinfo", "-h", "-o", "%P %G"], capture_output=True, text=True, check=True
    ).stdout
    partitions = {line.split()[0].rstrip("*"): line for line in out.splitlines()}
    assert {"cpu", "gpu"} <= set(partitions), out
    assert "gpu:1" in partitions["gpu"], out


def test_pipeline_on_slurm(cluster, tmp_path):
    wf = copy_workflow(tmp_path / "wf")
    t0 = time.perf_counter()
    run = snakemake(
        wf,
        "--profile",
        "profiles/slurm",
        "--configfile",
        "tests/config/config.yaml",
        "--jobs",
        "4",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--latency-wait",
        "5",
        "--set-threads",
        *THREADS,
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    print(f"SLURM run of the test config: {wall:.0f} s")
    assert run.returncode == 0, run.stdout[-12000:]  # stderr is merged into stdout
    assert (wf / "results" / "report.html").stat().st_size > 0

    # every job the DAG ran (all but the target rule) left a SLURM log named <jobid>.log
    logs = sorted((wf / "logs" / "slurm").rglob("*.log"))
    assert logs, "no SLURM job logs: jobs were not submitted through SLURM"
    jobs: dict[str, list[dict[str, str]]] = {}
    for log in logs:
        rule = log.relative_to(wf / "logs" / "slurm").parts[0].removeprefix("rule_")
        info = _scontrol_job(log.stem)
        assert info["JobState"] == "COMPLETED", (log, info)
        assert info["WorkDir"] == str(wf), info
        jobs.setdefault(rule, []).append(info)
    dry = snakemake(wf, "-n", "--configfile", "tests/config/config.yaml", "--forceall")
    planned = set(re.findall(r"^(?:local)?rule (\w+):", dry.stdout, flags=re.M)) - {"all"}
    assert planned and planned <= set(jobs), f"not run by SLURM: {planned - set(jobs)}"
    for rule, infos in jobs.items():
        for info in infos:
            if rule in GPU_RULES:
                assert info["Partition"] == "gpu", (rule, info)
                assert "gpu" in info.get("TresPerJob", "") + info.get("TresPerNode", ""), info
            else:
                assert info["Partition"] == "cpu", (rule, info)
    assert "engine" in jobs and "engine_bench" in jobs


def test_stopped_cluster_leaves_no_config(tmp_path):
    """`slurm_cluster.sh stop` removes the config `start` wrote, so that a machine with SLURM
    installed but no controller running starts `snakemake` at once: the SLURM executor plugin
    runs `scontrol show config` at import, which waits MessageTimeout (10 s) for a controller the
    config names. Run in a private mount namespace over a copy of /etc/slurm."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("scontrol"):
        pytest.skip("needs root, unshare and the SLURM client tools")
    if not os.path.isdir("/etc/slurm"):
        pytest.skip("no /etc/slurm to mount over")
    if _status() == 0:
        pytest.skip("a cluster is running here: stopping it would disturb its users")
    etc = tmp_path / "etc-slurm"
    etc.mkdir()
    mark = "# written by moesub scripts/slurm_cluster.sh"
    # what `start` writes, in short: a controller on this machine (not running)
    (etc / "slurm.conf").write_text(
        f"{mark}\nClusterName=moesub\nSlurmctldHost=localhost(127.0.0.1)\n"
        "NodeName=localhost NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN\n"
        "PartitionName=cpu Nodes=localhost Default=YES State=UP\n"
    )
    (etc / "gres.conf").write_text(f"{mark}\nAutoDetect=off\n")
    (etc / "user.conf").write_text("# not written by the script: kept\n")
    script = (
        f"mount --bind {etc} /etc/slurm && bash {CLUSTER} stop && s=$EPOCHREALTIME && "
        f'{BIN / "snakemake"} --version >/dev/null && echo "times $s $EPOCHREALTIME"'
    )
    run = subprocess.run(
        ["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in etc.iterdir()) == ["user.conf"], run.stdout
    start, end = map(float, re.search(r"times ([0-9.]+) ([0-9.]+)", run.stdout).groups())
    seconds = end - start
    print(f"snakemake --version without a cluster config: {seconds:.1f} s")
    assert seconds < 8, f"snakemake --version took {seconds:.1f} s without a cluster config"
