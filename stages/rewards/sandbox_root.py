"""The sandbox's own file tree (namespaces mode): what the launcher builds on an empty tmpfs before it
pivot_roots into it (`root_plan`), and the host folders masked inside it (`hidden_paths`)."""

from __future__ import annotations

import contextlib
import os
import sys

WORKDIR_BYTES = 32 * 2**20  # size of the tmpfs working directory (namespaces mode)
WORKDIR_INODES = 4096
# The sandbox's own root (namespaces mode): read-only binds of these host directories, or
# symlinks where the host has symlinks; these devices; nothing of /etc, /home, /root, /tmp.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "random", "urandom")
ROOT_TMPFS_OPTIONS = "size=1m,nr_inodes=1024,mode=0755"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8


def root_plan(base: str, program: str, workdir: str, prefix: str | None, uid: int | None) -> list[list]:
    """The sandbox's file tree, built by the launcher on an empty tmpfs, in order:
    ["dir", path] | ["symlink", path, target] | ["bind", path, source, remount flags] |
    ["overlay", path, source, flags, masked] | ["tmpfs", path, options]. An overlay is a read-only view
    of source in which the folders `masked` (paths relative to it) are empty, and whose mountinfo line
    names no host path. Everything is read-only except the working directory; `hidden_paths` that lie
    inside a bound folder are masked, the folder then mounted as an overlay."""
    ro = MS_RDONLY | MS_NOSUID | MS_NODEV
    plan: list[list] = []
    binds: list[tuple[str, list]] = []  # (host folder, its plan entry)
    for name in SYSTEM_DIRS:  # on merged-/usr systems all but /usr are symlinks into it
        path = "/" + name
        if os.path.islink(path):
            plan.append(["symlink", path, os.readlink(path)])
        elif os.path.isdir(path):
            plan.append(["bind", path, path, ro])
            binds.append((os.path.realpath(path), plan[-1]))
    plan += [["dir", "/proc"], ["dir", "/tmp"], ["dir", "/dev"]]
    for name in DEVICES:
        plan.append(["bind", f"/dev/{name}", f"/dev/{name}", MS_RDONLY | MS_NOSUID | MS_NOEXEC])
    plan.append(["symlink", "/dev/fd", "/proc/self/fd"])
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        plan.append(["symlink", f"/dev/{name}", f"/proc/self/fd/{fd}"])
    plan += [["dir", base], ["bind", program, program, ro | MS_NOEXEC]]
    if prefix:
        plan.append(["overlay", os.path.join(base, "python"), prefix, ro, []])
        binds.append((prefix, plan[-1]))
    options = f"size={WORKDIR_BYTES},nr_inodes={WORKDIR_INODES},mode=0700,uid={uid},gid={uid}"
    plan.append(["tmpfs", workdir, options])
    exe = os.path.realpath(sys.executable)
    masked: list[str] = []
    for hidden in sorted(hidden_paths()):  # e.g. a checkout in /usr/src/app; parents first
        if any(not os.path.relpath(hidden, m).startswith(os.pardir) for m in masked):
            continue  # inside a folder masked already (a venv in the checkout)
        for source, entry in binds:
            rel = os.path.relpath(hidden, source)
            # Two levels down at least: never /usr/lib or /usr/bin, nor what holds the interpreter.
            if (os.sep in rel and not rel.startswith(os.pardir) and os.path.isdir(hidden)
                    and os.path.relpath(exe, hidden).startswith(os.pardir)):
                if entry[0] == "bind":
                    entry[:] = ["overlay", *entry[1:], []]
                entry[4].append(rel)
                masked.append(hidden)
    return plan


def hidden_paths() -> list[str]:
    """Host folders the program must not see even where they lie inside a folder the sandbox
    binds (/usr, the interpreter's prefix): R1FLOW_HOME, PREFECT_HOME, the checkout, the working
    directory, the user's home and the virtual environment."""
    paths = [os.environ.get("R1FLOW_HOME", ".r1flow"), os.environ.get("PREFECT_HOME"),
             os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), os.path.expanduser("~"), sys.prefix]
    with contextlib.suppress(OSError):
        paths.append(os.getcwd())
    return sorted({os.path.realpath(p) for p in paths if p})
