"""The launcher process of `moesub.sandbox`: confinement set-up and supervision of one program.

The caller (`moesub.sandbox.run_untrusted`) starts this file as a script,
`python -I -S -B sandbox_launcher.py --moesub-sandbox-launch CONFIG FD`, a fresh single-threaded
process in its own session with a scrubbed environment. It enters the namespaces the host
allows, sets up the mounts, forks the program (dropping privileges and applying the resource
limits before exec), enforces the wall-clock deadline, and reports what it applied and how the
program ended as JSON lines on FD.

Isolated mode puts no package on the path: this module imports only the standard library, and
nothing from moesub (the caller imports its constants from here, not the other way round).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import resource
import select
import shutil
import signal
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import Any

LAUNCH_FLAG = "--moesub-sandbox-launch"
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
PROGRAM_NAME = "program.py"
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


def minimal_env(home: str) -> dict[str, str]:
    """The environment of the launcher and of the program: PATH, locale, HOME and TMPDIR."""
    return {
        "PATH": MINIMAL_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
    }


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
    target = os.path.join(workdir, PROGRAM_NAME)
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
        os.execve(python, [python, "-I", "-S", "-B", program], minimal_env(workdir))
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
                fallback = shutil.which("python3", path=MINIMAL_PATH)
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


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == LAUNCH_FLAG:
    sys.exit(_launch(json.loads(sys.argv[2]), int(sys.argv[3])))
