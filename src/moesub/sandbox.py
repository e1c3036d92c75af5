"""Isolated execution of untrusted (model-generated) Python programs.

`run_untrusted(code)` runs one program in a separate process and reports pass / fail / timeout /
crashed. Isolation, from the outside in:

* a *launcher* process (this file run as a script, started in a new session with a scrubbed
  environment) sets up the confinement and supervises the program; the program never sees the
  caller's environment, file descriptors or working directory;
* Linux namespaces where the OS allows them (as root, or through an unprivileged user
  namespace): a new **network** namespace (only a down loopback: no connection goes anywhere,
  not even to 127.0.0.1), a new **mount** namespace (the root filesystem bind-remounted
  read-only, fresh size-limited tmpfs over /tmp, /var/tmp, /run/lock and /dev/shm, the
  program's working directory on that tmpfs so it vanishes with the namespace), a new **PID**
  namespace (the program is its init: when it ends or is killed, the kernel kills everything it
  spawned, so no fork-bomb survivor can outlive the run) with its own /proc (no other process of
  the host is visible), and new IPC/UTS namespaces;
* an unprivileged uid (``nobody`` by default) with no supplementary groups and
  ``PR_SET_NO_NEW_PRIVS``: it cannot write or delete anything the host owns, read root-only
  files, or signal/ptrace the caller; RLIMIT_NPROC is per uid, so a fork bomb is capped;
* resource limits: CPU seconds, address space, file size, processes, open files, no core files;
  a wall-clock deadline after which the whole process tree is killed.

What could not be applied is recorded in the result (`network_isolated`, `mount_isolated`,
`pid_isolated`, `privileges_dropped`), never silently assumed. The program runs with
``python -I -S -B`` (isolated mode, no site-packages, no bytecode files): the standard library
only.

Status: ``pass`` = exit code 0; ``fail`` = non-zero exit (an exception, a failed assertion);
``timeout`` = wall-clock deadline or CPU limit reached; ``crashed`` = killed by a signal, hit the
memory or output limit; ``error`` = the sandbox itself failed (the launcher could not set up the
confinement, or the program could not be exec'd): the program's outcome is unknown, and callers
must treat the result as missing, never as a wrong program. An exec failure is told apart from a
program that exits 127 through a close-on-exec pipe: it carries the error only when the exec
itself did not happen.

`stdin` (optional text) is the program's standard input; it is never written where the program
can read it by path (a harness can hand a secret to code that runs after the untrusted part).

The launcher process is `moesub.sandbox_launcher` (run as a script under ``python -I -S``, so it
imports only the standard library); this module is the caller's side: limits, the result, and
how a run's report and exit status become a status.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moesub import sandbox_launcher
from moesub.sandbox_launcher import LAUNCH_FLAG, PROGRAM_NAME, minimal_env

STATUSES = ("pass", "fail", "timeout", "crashed", "error")
NAMESPACES = ("net", "mount", "pid", "ipc")


# --------------------------------------------------------------------------- public API
@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run (every limit applies to the program and all it spawns)."""

    timeout_s: float = 10.0  # wall clock, from program start to kill
    cpu_s: int | None = None  # CPU seconds per process (None: ceil(timeout_s))
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    max_file_mb: int = 16  # largest file the program may write, stdout/stderr included
    max_procs: int = 64  # processes + threads of the sandbox uid (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of each private tmpfs (working directory included)
    tail_bytes: int = 4096  # how much of the end of stdout / stderr the result keeps

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.cpu_s is not None and not (isinstance(self.cpu_s, int) and self.cpu_s >= 1):
            raise ValueError(f"cpu_s must be an int >= 1 or None, got {self.cpu_s!r}")
        for name in ("memory_mb", "max_file_mb", "max_procs", "max_open_files", "tmpfs_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError(f"max_open_files must be >= 16, got {self.max_open_files}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (Python needs ~30), got {self.memory_mb}")
        if not (isinstance(self.tail_bytes, int) and self.tail_bytes >= 0):
            raise ValueError(f"tail_bytes must be an int >= 0, got {self.tail_bytes!r}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_s if self.cpu_s is not None else max(1, int(-(-self.timeout_s // 1)))


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run."""

    status: str  # one of STATUSES
    returncode: int | None  # exit code, or -signal when killed by a signal, None if never ran
    stdout: str  # last `tail_bytes` of stdout (decoded, errors replaced)
    stderr: str  # last `tail_bytes` of stderr
    duration_s: float  # wall time of the program
    reason: str = ""  # exit | signal | wall_timeout | cpu_limit | memory | output_limit | sandbox
    cpu_s: float = 0.0  # CPU time of the program (user + system, waited-for children included)
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    network_isolated: bool = False
    mount_isolated: bool = False
    pid_isolated: bool = False
    privileges_dropped: bool = False
    uid: int | None = None  # uid the program ran as
    error: str = ""  # why the sandbox itself failed (status "error")
    notes: list[str] = field(default_factory=list)  # isolation steps that were not possible

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_untrusted(
    code: str,
    timeout_s: float = 10.0,
    cpu_s: int | None = None,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    max_procs: int = 64,
    *,
    max_open_files: int = 64,
    tmpfs_mb: int = 64,
    tail_bytes: int = 4096,
    user: str | int = "nobody",
    python: str | os.PathLike | None = None,
    isolate: Sequence[str] = NAMESPACES,
    stdin: str = "",
) -> SandboxResult:
    """Run the Python program `code` in the sandbox (see the module docstring) and classify it.

    `user` is the account the program runs as when this process may switch uid (root); it
    should be dedicated to sandboxed programs (RLIMIT_NPROC counts all its processes).
    `python` is the interpreter (default: this Python's base interpreter; only its standard
    library is visible to the program). `isolate` names the namespaces to try (a subset of
    NAMESPACES; fewer only to test the fallbacks or on hosts where one misbehaves). `stdin` is
    the program's standard input.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise ValueError(f"stdin must be a str, got {type(stdin).__name__}")
    unknown = sorted(set(isolate) - set(NAMESPACES))
    if isinstance(isolate, str) or unknown:
        raise ValueError(f"isolate must be a subset of {NAMESPACES}, got {isolate!r}")
    limits = SandboxLimits(
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_file_mb=max_file_mb,
        max_procs=max_procs,
        max_open_files=max_open_files,
        tmpfs_mb=tmpfs_mb,
        tail_bytes=tail_bytes,
    )
    interpreter = _interpreter(python)
    uid, gid = _sandbox_ids(user)
    with _private_dir() as private:
        program = private / PROGRAM_NAME
        program.write_text(code, encoding="utf-8")
        (private / "stdin").write_text(stdin, encoding="utf-8")  # 0600: the caller's only
        workdir = private / "work"  # used only when no mount namespace can be made
        workdir.mkdir()
        if uid is not None:
            os.chown(workdir, uid, gid)
            os.chmod(private, 0o711)  # the program may enter work/, not list or read the rest
            os.chmod(program, 0o644)
        cfg = {
            "program": str(program),
            "fallback_workdir": str(workdir),
            "python": interpreter,
            "python_prefixes": _prefixes(interpreter),
            "uid": uid,
            "gid": gid,
            "isolate": sorted(isolate),
            "limits": asdict(limits) | {"cpu_s": limits.cpu_seconds},
        }
        return _supervise(cfg, limits, private)


def probe_isolation() -> dict[str, bool]:
    """Which isolation steps this host allows (runs one trivial program)."""
    r = run_untrusted("pass\n", timeout_s=10)
    return {
        "network_isolated": r.network_isolated,
        "mount_isolated": r.mount_isolated,
        "pid_isolated": r.pid_isolated,
        "privileges_dropped": r.privileges_dropped,
    }


# --------------------------------------------------------------------------- caller side
def _interpreter(python: str | os.PathLike | None) -> str:
    if python is None:
        python = getattr(sys, "_base_executable", None) or sys.executable
    path = os.path.realpath(os.fspath(python))
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"python: interpreter {path!r} does not exist or is not executable")
    return path


def _prefixes(interpreter: str) -> list[str]:
    """Directories the interpreter needs (its prefix: binary, libpython, standard library)."""
    if os.path.realpath(getattr(sys, "_base_executable", "") or "") == interpreter:
        dirs = {sys.base_prefix, sys.base_exec_prefix}
    else:
        dirs = {str(Path(interpreter).parent.parent)}
    return sorted(os.path.realpath(d) for d in dirs)


def _sandbox_ids(user: str | int) -> tuple[int | None, int | None]:
    """(uid, gid) to run as, or (None, None) when this process cannot switch uid."""
    if os.geteuid() != 0:
        return None, None
    try:
        entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
    except KeyError as exc:
        raise ValueError(f"user: no account {user!r} on this host") from exc
    if entry.pw_uid == 0:
        raise ValueError(f"user: {user!r} is root; the sandbox needs an unprivileged account")
    return entry.pw_uid, entry.pw_gid


@contextlib.contextmanager
def _private_dir():
    path = Path(tempfile.mkdtemp(prefix="moesub-sandbox-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _tail(path: Path, n: int) -> tuple[str, int]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(max(0, size - n))
        data = fh.read(n) if n else b""
    return data.decode("utf-8", errors="replace"), size


def _supervise(cfg: dict[str, Any], limits: SandboxLimits, private: Path) -> SandboxResult:
    out_path, err_path, in_path = private / "stdout", private / "stderr", private / "stdin"
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    report: dict[str, Any] = {}
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err, open(in_path, "rb") as inp:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-B",
                    os.path.abspath(sandbox_launcher.__file__),
                    LAUNCH_FLAG,
                    json.dumps(cfg),
                    str(write_fd),
                ],
                stdin=inp,
                stdout=out,
                stderr=err,
                env=minimal_env("/"),
                cwd="/",
                pass_fds=(write_fd,),
                start_new_session=True,
                close_fds=True,
            )
        os.close(write_fd)
        write_fd = -1
        # The launcher enforces the deadline itself; this is the backstop if it cannot.
        try:
            proc.wait(timeout=limits.timeout_s + 15.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        report = _read_report(read_fd)
        if proc.returncode != 0 and "error" not in report:
            report["error"] = f"sandbox launcher exited with {proc.returncode}"
        if "program_pid" in report and "wait_status" not in report:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(report["program_pid"]), signal.SIGKILL)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
    stdout, n_out = _tail(out_path, limits.tail_bytes)
    stderr, n_err = _tail(err_path, limits.tail_bytes)
    result = SandboxResult(
        status="crashed",
        returncode=None,
        stdout=stdout,
        stderr=stderr,
        duration_s=float(report.get("duration_s", time.monotonic() - start)),
        cpu_s=float(report.get("cpu_s", 0.0)),
        stdout_bytes=n_out,
        stderr_bytes=n_err,
        network_isolated=bool(report.get("network_isolated", False)),
        mount_isolated=bool(report.get("mount_isolated", False)),
        pid_isolated=bool(report.get("pid_isolated", False)),
        privileges_dropped=bool(report.get("privileges_dropped", False)),
        uid=report.get("uid"),
        error=str(report.get("error", "")),
        notes=list(report.get("notes", [])),
    )
    _classify(result, report, limits)
    return result


def _read_report(fd: int) -> dict[str, Any]:
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], 5.0)
        if not ready:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    report: dict[str, Any] = {}
    for line in b"".join(chunks).decode("utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            report.update(json.loads(line))
    return report


def _classify(result: SandboxResult, report: dict[str, Any], limits: SandboxLimits) -> None:
    if "exec_error" in report or "wait_status" not in report:
        result.status, result.reason = "error", "sandbox"
        result.error = (
            result.error
            or report.get("exec_error")
            or "the sandbox did not report the program's exit"
        )
        return
    ws = int(report["wait_status"])
    output_limit = max(result.stdout_bytes, result.stderr_bytes) >= limits.max_file_mb << 20
    if report.get("timed_out"):
        result.status, result.reason = "timeout", "wall_timeout"
        result.returncode = -signal.SIGKILL
    elif os.WIFSIGNALED(ws):
        sig = os.WTERMSIG(ws)
        result.returncode = -sig
        if sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and result.cpu_s >= limits.cpu_seconds - 0.05
        ):
            result.status, result.reason = "timeout", "cpu_limit"
        elif sig == signal.SIGXFSZ or output_limit:
            result.status, result.reason = "crashed", "output_limit"
        else:
            result.status, result.reason = "crashed", "signal"
    else:
        code = os.WEXITSTATUS(ws)
        result.returncode = code
        if code == 0:
            result.status, result.reason = "pass", "exit"
        elif output_limit:
            result.status, result.reason = "crashed", "output_limit"
        elif _last_line(result.stderr).startswith("MemoryError"):
            result.status, result.reason = "crashed", "memory"
        else:
            result.status, result.reason = "fail", "exit"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""
