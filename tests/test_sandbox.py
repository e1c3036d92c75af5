"""moesub.sandbox: status classification and hostile programs that must not escape."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from moesub.sandbox import (
    STATUSES,
    SandboxLimits,
    probe_isolation,
    run_untrusted,
)

ISOLATION = probe_isolation()
needs_uid_drop = pytest.mark.skipif(
    not ISOLATION["privileges_dropped"], reason="cannot switch to an unprivileged uid here"
)
needs_netns = pytest.mark.skipif(
    not ISOLATION["network_isolated"], reason="no network namespace on this host"
)
needs_pidns = pytest.mark.skipif(
    not ISOLATION["pid_isolated"], reason="no PID namespace on this host"
)


def run(code: str, **kw):
    kw.setdefault("timeout_s", 10)
    return run_untrusted(textwrap.dedent(code), **kw)


def processes_of(uid: int, wait_s: float = 3.0) -> list[int]:
    """Live (non-zombie) processes of `uid`, after giving SIGKILLed ones `wait_s` to die."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    fields = dict(
                        line.split(":", 1)
                        for line in Path(f"/proc/{entry}/status").read_text().splitlines()
                    )
                except (OSError, ValueError):
                    continue
                if int(fields["Uid"].split()[0]) == uid and fields["State"].strip()[0] not in "ZX":
                    pids.append(int(entry))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def assert_still_works():
    r = run("print(sum(range(10)))")
    assert r.status == "pass", r
    assert r.stdout.strip() == "45"


@pytest.fixture
def outside_dir(tmp_path):
    """A world-writable directory on the host's root filesystem (not under /tmp, which the
    sandbox replaces anyway), holding a root-owned file."""
    try:
        d = Path(tempfile.mkdtemp(prefix=".moesub-sandbox-victim-", dir="/"))
    except OSError:
        d = tmp_path / "victim"
        d.mkdir()
    os.chmod(d, 0o777)
    (d / "precious.txt").write_text("keep me")
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


# --------------------------------------------------------------------------- classification
def test_pass_fail_and_output():
    r = run("print('hello'); import sys; print('oops', file=sys.stderr)")
    assert r.status == "pass" and r.returncode == 0 and r.reason == "exit"
    assert r.stdout == "hello\n" and r.stderr == "oops\n"
    assert r.duration_s < 10

    r = run("assert 1 + 1 == 3, 'arithmetic'")
    assert r.status == "fail" and r.returncode == 1
    assert "AssertionError: arithmetic" in r.stderr

    r = run("def f(:\n    pass")
    assert r.status == "fail" and "SyntaxError" in r.stderr

    r = run("import sys; sys.exit(3)")
    assert r.status == "fail" and r.returncode == 3


def test_standard_library_only():
    r = run("import math, re, hashlib, collections; print(math.comb(5, 2))")
    assert r.status == "pass" and r.stdout.strip() == "10"
    r = run("import numpy")
    assert r.status == "fail" and "ModuleNotFoundError" in r.stderr


def test_segfault_is_a_crash():
    r = run("import ctypes; ctypes.string_at(0)")
    assert r.status == "crashed" and r.reason == "signal" and r.returncode == -11


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_untrusted("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_untrusted("pass", memory_mb=8)
    with pytest.raises(ValueError, match="code"):
        run_untrusted(b"pass")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)


# --------------------------------------------------------------------------- hostile programs
def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = run("while True:\n    pass", timeout_s=1.5)
    assert r.status == "timeout" and r.reason == "wall_timeout"
    assert 1.4 <= r.duration_s < 4 and time.monotonic() - t0 < 6
    assert_still_works()


def test_sleeping_program_times_out():
    r = run("import time; time.sleep(60)", timeout_s=1)
    assert r.status == "timeout" and r.duration_s < 3


def test_cpu_limit():
    # Busy threads burn CPU faster than the wall clock on >1 core; a single busy loop hits
    # the CPU limit before the generous wall-clock deadline either way.
    r = run("while True:\n    pass", timeout_s=20, cpu_s=1)
    assert r.status == "timeout" and r.reason == "cpu_limit", r
    assert r.duration_s < 10


@needs_uid_drop
def test_fork_bomb_is_contained():
    code = """
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
    """
    t0 = time.monotonic()
    r = run(code, timeout_s=2, max_procs=32)
    assert r.status in ("timeout", "fail", "crashed"), r
    assert time.monotonic() - t0 < 10
    assert processes_of(r.uid) == [], "fork bomb survivors"
    assert_still_works()


@needs_pidns
def test_daemonized_child_does_not_outlive_the_run():
    code = """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(120)
        os._exit(0)
    print('parent done')
    """
    r = run(code)
    assert r.status == "pass" and "parent done" in r.stdout
    if r.privileges_dropped:
        assert processes_of(r.uid) == []


def test_memory_bomb():
    code = """
    blocks = []
    while True:
        blocks.append(bytearray(32 * 2**20))
    """
    r = run(code, memory_mb=256)
    assert r.status == "crashed" and r.reason == "memory", r
    r = run("x = bytearray(10**12)", memory_mb=256)
    assert r.status == "crashed" and r.reason == "memory"
    assert_still_works()


def test_huge_output_is_capped():
    code = """
    import sys
    line = 'x' * 1023 + '\\n'
    for _ in range(100_000):  # 100 MB
        sys.stdout.write(line)
    """
    r = run(code, max_file_mb=1, tail_bytes=2048)
    assert r.status == "crashed" and r.reason == "output_limit", r
    assert r.stdout_bytes <= 1 << 20 and len(r.stdout) <= 2048
    assert_still_works()


@needs_uid_drop
def test_cannot_write_or_delete_outside(outside_dir, tmp_path):
    victim = outside_dir / "precious.txt"
    tmp_victim = tmp_path / "precious.txt"
    tmp_victim.write_text("keep me too")
    code = f"""
    import json, os
    results = {{}}
    targets = [{str(outside_dir / "escaped.txt")!r}, '/tmp/moesub-escaped.txt',
               '/root/moesub-escaped.txt', '/moesub-escaped.txt', {str(tmp_path / "x")!r}]
    for path in targets:
        try:
            with open(path, 'w') as fh:
                fh.write('escaped')
            results[path] = 'written'
        except OSError as exc:
            results[path] = type(exc).__name__
    for path in [{str(victim)!r}, {str(tmp_victim)!r}]:
        try:
            os.remove(path)
            results[path] = 'deleted'
        except OSError as exc:
            results[path] = type(exc).__name__
    try:
        os.chmod({str(victim)!r}, 0o777)
        results['chmod'] = 'done'
    except OSError as exc:
        results['chmod'] = type(exc).__name__
    open('inside.txt', 'w').write('fine')  # its own directory is writable
    print(json.dumps(results))
    """
    r = run(code)
    assert r.status == "pass", r
    assert victim.read_text() == "keep me" and tmp_victim.read_text() == "keep me too"
    assert (victim.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in outside_dir.iterdir()) == ["precious.txt"]
    assert not Path("/tmp/moesub-escaped.txt").exists()
    assert not Path("/root/moesub-escaped.txt").exists()
    assert not Path("/moesub-escaped.txt").exists()
    assert not (tmp_path / "x").exists()
    results = json.loads(r.stdout)
    # /tmp inside the sandbox is its own throw-away tmpfs: writing there is allowed and harmless
    assert results.pop("/tmp/moesub-escaped.txt") == "written"
    assert "written" not in results.values() and "deleted" not in results.values(), results
    assert results["chmod"] != "done"
    assert_still_works()


def test_working_directory_is_fresh():
    r1 = run("import os; print(sorted(os.listdir('.'))); open('left.txt', 'w').write('x')")
    r2 = run("import os; print(sorted(os.listdir('.')))")
    assert r1.status == r2.status == "pass"
    assert "left.txt" not in r2.stdout


@needs_netns
def test_no_network_even_to_localhost():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = f"""
        import socket
        s = socket.create_connection(('127.0.0.1', {port}), timeout=2)
        s.sendall(b'escaped')
        print('connected')
        """
        r = run(code)
        assert r.status == "fail", r
        assert "connected" not in r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected
        r = run("import socket; socket.getaddrinfo('pypi.org', 443)")
        assert r.status == "fail"
    finally:
        server.close()


def test_parent_environment_is_invisible(monkeypatch):
    secret = "moesub-secret-4f9c2a"
    monkeypatch.setenv("MOESUB_SANDBOX_SECRET", secret)
    code = """
    import os
    print(dict(os.environ))
    for pid in os.listdir('/proc'):
        if pid.isdigit():
            for name in ('environ', 'cmdline'):
                try:
                    with open(f'/proc/{pid}/{name}', 'rb') as fh:
                        print(pid, name, fh.read())
                except OSError as exc:
                    print(pid, name, type(exc).__name__)
    """
    r = run(code)
    assert r.status == "pass", r
    assert secret not in r.stdout and "MOESUB_SANDBOX_SECRET" not in r.stdout
    assert r.stdout.startswith("{") and "'PATH'" in r.stdout


@needs_uid_drop
def test_fallback_without_namespaces(outside_dir):
    """No namespace at all: the unprivileged uid, the rlimits and the session kill still hold
    (a world-writable directory is then writable: only the read-only mounts prevent that)."""
    os.chmod(outside_dir, 0o755)
    victim = outside_dir / "precious.txt"
    code = f"""
    import os
    try:
        os.remove({str(victim)!r})
    except OSError as exc:
        print(type(exc).__name__)
    print(os.getuid())
    """
    r = run(code, isolate=())
    if not r.privileges_dropped:
        pytest.skip(f"no interpreter reachable by the sandbox uid here: {r.error or r.notes}")
    assert r.status == "pass", r
    assert not (r.network_isolated or r.mount_isolated or r.pid_isolated)
    assert victim.read_text() == "keep me" and r.stdout.split() == ["PermissionError", "65534"]
    code = """
    import os, time
    if os.fork() == 0:
        os.setpgid(0, 0)  # leaves the process group, not the session
        time.sleep(120)
    while True:
        pass
    """
    r = run(code, timeout_s=1, isolate=())
    assert r.status == "timeout"
    assert processes_of(r.uid) == []
    with pytest.raises(ValueError, match="isolate"):
        run_untrusted("pass", isolate=("bogus",))


# ------------------------------------------------------------------ the sandbox's own failures
def test_stdin_reaches_the_program():
    r = run("import sys; print(sys.stdin.read().upper())", stdin="secret\n")
    assert r.status == "pass" and r.stdout.strip() == "SECRET"
    with pytest.raises(ValueError, match="stdin"):
        run_untrusted("pass", stdin=b"x")  # type: ignore[arg-type]


def test_correct_programs_never_crash():
    """Ordinary correct programs (threads, a subprocess, 200 MB, deep recursion, a temp file)
    come back `pass` under the default limits: never `crashed` or `error`."""
    programs = [
        "import threading\nts = [threading.Thread(target=sum, args=([1],)) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]",
        "import subprocess, sys\nassert subprocess.run([sys.executable, '-c', 'pass']).returncode"
        " == 0",
        "x = bytearray(200 * 2**20); assert len(x) == 200 * 2**20",
        "import sys\nsys.setrecursionlimit(5000)\nf = lambda n: n and 1 + f(n - 1)\n"
        "assert f(3000) == 3000",
        "import tempfile\nwith tempfile.TemporaryFile() as fh:\n    fh.write(b'x' * 10**6)",
    ]
    for code in programs:
        r = run(code)
        assert r.status == "pass", (code, r)


def test_exec_failure_is_the_sandbox_error(tmp_path):
    """An interpreter that cannot be exec'd: status `error` (the program never ran), never
    `fail` (which a program exiting 127 is)."""
    not_python = tmp_path / "python3"
    not_python.write_bytes(b"\x00\x01 not an executable format\n")
    not_python.chmod(0o755)
    r = run("print('hi')", python=not_python)
    assert r.status == "error" and r.reason == "sandbox", r
    assert "cannot start the program" in r.error or "not reachable" in r.error, r.error
    r = run("import sys; sys.exit(127)")
    assert r.status == "fail" and r.returncode == 127 and not r.error
    assert "error" in STATUSES
