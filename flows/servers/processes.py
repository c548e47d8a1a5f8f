"""Processes and ports on this machine, for the servers r1flow starts (flows/servers/servers.py, `r1flow ui`) and for
the owners of folders and runs (flows/store/artifacts.py): is a process (pid and start time) still the same and running,
stop a process group with a grace, who holds a port, the tail of a log, is a URL healthy.

Linux reads /proc (a reused pid is told apart by its start time, field 22 of /proc/<pid>/stat); without /proc
(macOS) signal 0 answers what it can. Standard library only: `r1flow up` must not pay for importing Prefect.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 25


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start ticks) from /proc/<pid>/stat, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may contain spaces and parens
    return fields[0], int(fields[2]), int(fields[19])


def have_proc() -> bool:
    return Path("/proc/self/stat").exists()


def pid_start_ticks(pid: int) -> int | None:
    st = proc_stat(pid) if have_proc() else None
    return st[2] if st else None


def reap(pid: int) -> None:
    """Collect our own exited child so it does not linger as a zombie (no-op for other pids)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def running(pid: int, start_ticks: int | None = None) -> bool:
    """Is this the same, still running process? Zombies count as dead; a reused pid too."""
    if pid <= 0:
        return False
    reap(pid)
    if have_proc():
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        return start_ticks is None or st[2] == start_ticks
    return _signal0(pid)


def _signal0(pid: int) -> bool:
    """Without /proc: does signal 0 find the pid (EPERM: it exists, owned by someone else)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_exists(pid: int) -> bool:
    """Is there any process (zombies excluded) with this pid?"""
    if have_proc():
        st = proc_stat(pid)
        return st is not None and st[0] not in ("Z", "X")
    return _signal0(pid)


def group_alive(pgid: int) -> bool:
    """Does any live (non-zombie) process remain in this process group?"""
    if have_proc():
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                st = proc_stat(int(entry.name))
                if st and st[1] == pgid and st[0] not in ("Z", "X"):
                    return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def send_signal(pid: int, pgid: int | None, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if pgid:
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)


def terminate(pid: int, pgid: int | None, grace: float = STOP_GRACE_S) -> str:
    """SIGTERM (to the group when given), wait up to `grace` s, then SIGKILL. Says which it took."""
    def gone() -> bool:
        reap(pid)
        if group_alive(pgid) if pgid else running(pid):
            return False
        reap(pid)  # the leader may have turned zombie since the first call
        return True

    send_signal(pid, pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if gone():
            return "SIGTERM"
        time.sleep(0.1)
    send_signal(pid, pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not gone():
        time.sleep(0.05)
    return "SIGKILL"


def port_holder(port: int) -> str | None:
    """`pid N (command)` of the process listening on this TCP port, when this user can see it (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {proc.name} ({cmd[:80]}{'...' if len(cmd) > 80 else ''})"
        except OSError:
            continue
    return None


def port_taken_message(port: int, host: str, e: OSError, whose: str) -> str:
    """One line: which port, whose it is (`whose`), and what holds it when known."""
    holder = port_holder(port) if e.errno == errno.EADDRINUSE else None
    why = f"in use by {holder}" if holder else f"not available ({e.strerror})"
    return f"port {host}:{port} ({whose}) is {why}"


def console_script(name: str) -> list[str]:
    """The venv's console script next to this interpreter, else `python -m name`."""
    exe = Path(sys.executable).parent / name
    return [str(exe)] if exe.exists() else [sys.executable, "-m", name]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = text.strip().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) if tail else "    (log is empty)"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
