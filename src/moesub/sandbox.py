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

This module imports only the standard library: the launcher runs it as a script under
``python -I -S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import pwd
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("pass", "fail", "timeout", "crashed", "error")
NAMESPACES = ("net", "mount", "pid", "ipc")
_LAUNCH_FLAG = "--moesub-sandbox-launch"
_MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
_PROGRAM_NAME = "program.py"
_TMPFS_DIRS = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")
_WORKDIR_IN_NS = "/tmp/sandbox"
_VIRTUAL_FS = ("/proc", "/sys", "/dev")  # left as they are (device nodes stay usable)

# linux/sched.h, linux/mount.h, linux/prctl.h
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_RELATIME = 0x200000
_ST_TO_MS = (  # statvfs f_flag bit -> mount flag
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38


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
        program = private / _PROGRAM_NAME
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


def _minimal_env(home: str) -> dict[str, str]:
    return {
        "PATH": _MINIMAL_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
    }


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
                    os.path.abspath(__file__),
                    _LAUNCH_FLAG,
                    json.dumps(cfg),
                    str(write_fd),
                ],
                stdin=inp,
                stdout=out,
                stderr=err,
                env=_minimal_env("/"),
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


# --------------------------------------------------------------------------- launcher side
# Everything below runs in the launcher process (`python -I -S sandbox.py --moesub-sandbox-launch
# CONFIG FD`), a fresh single-threaded process in its own session.

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        _libc.unshare.argtypes = [ctypes.c_int]
        _libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> bool:
    return _lib().unshare(flags) == 0


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(_lib().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_lib().prctl(option, arg, 0, 0, 0), f"prctl {option}")


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _enter_user_namespace() -> bool:
    """Unprivileged fallback: a user namespace mapping our uid to root inside it."""
    uid, gid = os.getuid(), os.getgid()
    if not _unshare(CLONE_NEWUSER):
        return False
    try:
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"0 {uid} 1")
        _write_file("/proc/self/gid_map", f"0 {gid} 1")
    except OSError:
        pass  # unmapped: we still hold the namespace's capabilities
    return True


def _traversable(path: str) -> bool:
    """Whether an unprivileged 'other' user can reach `path` (x on every ancestor, r on it)."""
    p = Path(path)
    for ancestor in [*reversed(p.parents), p]:
        try:
            mode = os.stat(ancestor).st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return bool(os.stat(p).st_mode & stat.S_IROTH)


def _expose_prefix(prefix: str, size_mb: int, notes: list[str]) -> None:
    """Make an interpreter prefix under a private directory (e.g. /root/...) reachable by
    the sandbox uid: a tmpfs over the top-most closed ancestor (hiding everything else in it)
    with the prefix bind-mounted read-only at its own path."""
    p = Path(prefix)
    closed = next(
        (a for a in [*reversed(p.parents), p] if not os.stat(a).st_mode & stat.S_IXOTH), None
    )
    if closed is None or closed == p:
        if closed is not None:
            notes.append(f"interpreter prefix {prefix} is not world-readable")
        return
    fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
    try:
        _mount("tmpfs", str(closed), "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=755")
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", prefix, None, MS_BIND | MS_REC)
        _mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    finally:
        os.close(fd)


def _mountpoints() -> list[str]:
    """Mount points of this mount namespace, parents before children."""
    points = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            raw = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), raw))  # \\040
    return sorted(set(points), key=lambda p: (p.count("/"), p))


def _remount_readonly(mountpoint: str) -> None:
    """Bind-remount one mount read-only in this namespace (per-mount flags only: the host's
    view and the filesystem itself are untouched), keeping its other flags (they may be
    locked in a user namespace)."""
    st = os.statvfs(mountpoint)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    for st_flag, ms_flag in _ST_TO_MS:
        if st.f_flag & st_flag:
            flags |= ms_flag
    _mount(None, mountpoint, None, flags)


def _setup_mounts(cfg: dict[str, Any], notes: list[str]) -> str:
    """In the new mount namespace: read-only root, private tmpfs dirs, the working directory.
    Returns the program's working directory."""
    limits = cfg["limits"]
    size = int(limits["tmpfs_mb"])
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    prefixes = [d for d in cfg["python_prefixes"] if not _traversable(d)]
    for prefix in prefixes:
        _expose_prefix(prefix, size, notes)
    for mountpoint in _mountpoints():
        if mountpoint in _TMPFS_DIRS or any(
            mountpoint == v or mountpoint.startswith(v + "/") for v in _VIRTUAL_FS
        ):
            continue
        try:
            _remount_readonly(mountpoint)
        except OSError as exc:
            notes.append(f"{mountpoint} stays writable: {exc}")
    for d in _TMPFS_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            try:
                _mount(
                    "tmpfs",
                    d,
                    "tmpfs",
                    MS_NOSUID | MS_NODEV,
                    f"size={size}m,nr_inodes=4096,mode=1777",
                )
            except OSError as exc:
                notes.append(f"{d} not replaced: {exc}")
    workdir = _WORKDIR_IN_NS
    os.mkdir(workdir, 0o700)
    return workdir


def _place_program(cfg: dict[str, Any], workdir: str, code: bytes) -> str:
    target = os.path.join(workdir, _PROGRAM_NAME)
    if os.path.abspath(cfg["program"]) != target:
        with open(target, "wb") as fh:
            fh.write(code)
    os.chmod(target, 0o644)
    if cfg["uid"] is not None:
        os.chown(workdir, cfg["uid"], cfg["gid"])
    return target


def _rlimits(limits: dict[str, Any]) -> None:
    mb = 1 << 20
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # soft: SIGXCPU, hard: SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_procs"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _exec_program(
    cfg: dict[str, Any], workdir: str, program: str, pid_ns: bool, mount_ns: bool, error_fd: int
) -> None:
    """Child side: never returns (execs the program, or writes why not to the close-on-exec
    `error_fd` and exits 127)."""
    try:
        if pid_ns and mount_ns:  # never over the host's /proc
            with contextlib.suppress(OSError):  # a /proc showing only this namespace
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        else:
            os.setsid()  # own session/group, so the launcher can kill the whole group
        _rlimits(cfg["limits"])
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid (a uid change clears it)
        os.chdir(workdir)
        os.umask(0o077)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        python = cfg["python"]
        os.execve(python, [python, "-I", "-S", "-B", program], _minimal_env(workdir))
    except BaseException:  # noqa: BLE001 - report anything, never fall back into the launcher
        with contextlib.suppress(BaseException):
            os.write(error_fd, f"cannot start the program:\n{traceback.format_exc()}".encode())
        os._exit(127)


def _kill_tree(pid: int, pid_ns: bool) -> None:
    """Kill the program and everything it spawned."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # with a PID namespace this takes the whole namespace
    if pid_ns:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for entry in os.listdir("/proc"):  # same session (escapes from the process group)
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == pid:  # field 6 (session) of /proc/PID/stat
                    os.kill(int(entry), signal.SIGKILL)


def _wait(pid: int, deadline: float) -> tuple[int | None, Any]:
    """waitpid with a deadline: (wait status, rusage) or (None, None) on timeout."""
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(pid)
    try:
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                return status, usage
            left = deadline - time.monotonic()
            if left <= 0:
                return None, None
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.01))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _read_until_eof(fd: int, deadline: float) -> str:
    """Everything written to the pipe `fd` until its last writer closes it (or the deadline)."""
    chunks = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                break
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _launch(cfg: dict[str, Any], report_fd: int) -> int:
    os.set_inheritable(report_fd, False)
    notes: list[str] = []
    host_uid = os.getuid()
    info: dict[str, Any] = {}

    def emit(obj: dict[str, Any]) -> None:
        os.write(report_fd, (json.dumps(obj) + "\n").encode())

    try:
        with open(cfg["program"], "rb") as fh:  # before /tmp is replaced
            code = fh.read()
        if os.geteuid() != 0 and not _enter_user_namespace():
            notes.append("no user namespace: running without namespaces")
        wanted = set(cfg["isolate"])
        info["network_isolated"] = "net" in wanted and _unshare(CLONE_NEWNET)
        info["mount_isolated"] = "mount" in wanted and _unshare(CLONE_NEWNS)
        if "ipc" in wanted:
            _unshare(CLONE_NEWIPC | CLONE_NEWUTS)
        info["pid_isolated"] = "pid" in wanted and _unshare(CLONE_NEWPID)
        workdir = cfg["fallback_workdir"]
        if info["mount_isolated"]:
            try:
                workdir = _setup_mounts(cfg, notes)
            except OSError as exc:
                notes.append(f"mount namespace setup failed ({exc}); using {workdir}")
                info["mount_isolated"] = False
        if cfg["uid"] is not None and not info["mount_isolated"]:
            prefixes = [d for d in cfg["python_prefixes"] if not _traversable(d)]
            if prefixes or not _traversable(cfg["python"]):
                fallback = shutil.which("python3", path=_MINIMAL_PATH)
                if fallback and _traversable(os.path.realpath(fallback)):
                    cfg["python"] = os.path.realpath(fallback)
                    notes.append(f"interpreter not reachable by the sandbox uid; using {fallback}")
                else:  # never run untrusted code as root without namespaces
                    raise RuntimeError(
                        f"the interpreter {cfg['python']} is not reachable by uid {cfg['uid']} "
                        "and no mount namespace can expose it: refusing to run the program "
                        "as root; pass python= an interpreter that every user can run"
                    )
        info["privileges_dropped"] = cfg["uid"] is not None
        info["uid"] = cfg["uid"] if cfg["uid"] is not None else host_uid
        program = _place_program(cfg, workdir, code)
        info["notes"] = notes
        emit(info)
        error_r, error_w = os.pipe2(os.O_CLOEXEC)  # closed by a successful exec, unread
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(error_r)
            _exec_program(
                cfg, workdir, program, info["pid_isolated"], info["mount_isolated"], error_w
            )
        os.close(error_w)
        emit({"program_pid": pid})
        deadline = start + float(cfg["limits"]["timeout_s"])
        exec_error = _read_until_eof(error_r, deadline)
        if exec_error:
            emit({"exec_error": exec_error})
        status, usage = _wait(pid, deadline)
        timed_out = status is None
        if timed_out:
            _kill_tree(pid, info["pid_isolated"])
            _, status, usage = os.wait4(pid, 0)
        elif not info["pid_isolated"]:
            _kill_tree(pid, False)  # leftovers of a program that exited
        emit(
            {
                "wait_status": status,
                "timed_out": timed_out,
                "duration_s": time.monotonic() - start,
                "cpu_s": usage.ru_utime + usage.ru_stime,
            }
        )
        return 0
    except BaseException:  # noqa: BLE001 - the caller turns this into status "error"
        with contextlib.suppress(BaseException):
            emit({"error": traceback.format_exc(), "notes": notes})
        return 2


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == _LAUNCH_FLAG:
    sys.exit(_launch(json.loads(sys.argv[2]), int(sys.argv[3])))
