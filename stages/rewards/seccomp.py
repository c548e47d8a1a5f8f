"""The seccomp filter the sandbox installs right before the program's exec (`seccomp_filter`), built
from a few BPF opcodes."""

from __future__ import annotations

import errno
import struct

# Syscalls the program may not make (a seccomp filter, both modes), by architecture: the audit
# arch of seccomp_data and the numbers (x86_64: asm/unistd_64.h; aarch64 and riscv64 share
# asm-generic/unistd.h; those from 424 on are the same everywhere). Why these, see `seccomp_filter`.
_SECCOMP_NEW = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
                "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
                "clone3": 435, "mount_setattr": 442, "open_tree_attr": 467}
_SECCOMP_GENERIC = {"unshare": 97, "setns": 268, "clone": 220, "mount": 40, "umount2": 39, "pivot_root": 41,
                    "chroot": 51, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219,
                    "add_key": 217, "request_key": 218, **_SECCOMP_NEW}
SECCOMP_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {"unshare": 272, "setns": 308, "clone": 56, "mount": 165, "umount2": 166,
                            "pivot_root": 155, "chroot": 161, "bpf": 321, "perf_event_open": 298,
                            "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249, **_SECCOMP_NEW}),
    "aarch64": (0xC00000B7, _SECCOMP_GENERIC),
    "riscv64": (0xC00000F3, _SECCOMP_GENERIC),
}
# clone() flags that make a namespace (CLONE_NEWTIME, 0x80, is not one for clone(): there the low
# byte is the exit signal).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


def seccomp_filter(machine: str, deny_errno: int = errno.EPERM) -> bytes | None:
    """The seccomp program the launcher installs (prctl PR_SET_SECCOMP) right before it execs the
    program, as struct sock_filter[] in native byte order; None for an architecture that
    SECCOMP_ARCHES does not list.

    Denied with deny_errno (EPERM: PermissionError in Python), for the program and everything it
    starts (filters are inherited and cannot be removed):
      - namespaces: unshare, setns, and clone with any CLONE_NEW* flag. As an unprivileged user a
        program could otherwise make a user namespace, be root in it and reach kernel code that
        is otherwise root-only (mounting filesystems, netfilter, ...), the source of many local
        privilege escalations; a reward program never needs one. clone without these flags (fork,
        vfork, threads) passes. clone3 passes its flags in memory a filter cannot read, so it
        fails with ENOSYS, as in Docker's and systemd's filters: glibc then falls back to clone;
      - mounts: mount, umount2, pivot_root, chroot and the new mount API (open_tree, move_mount,
        fsopen, fsconfig, fsmount, fspick, mount_setattr, open_tree_attr). Without a user
        namespace they need privileges the program lacks; denying them too does not depend on
        that, nor on the uid change;
      - kernel interfaces with a record of privilege escalations that no stdlib program needs and
        that Docker's default profile also refuses: bpf, perf_event_open, userfaultfd, io_uring
        (its operations run without any syscall a filter could see), and the key management
        calls keyctl, add_key and request_key (keyrings are not namespaced: a key stored under a
        sandbox uid would outlive the run and be readable by the next run in that uid slot).
    Everything else passes: the limits and the namespaces do the rest of the work. On x86_64 the
    x32 ABI (syscall numbers from 0x40000000, which would bypass the numbers above) fails with
    ENOSYS, and a syscall of another ABI (i386 through int 0x80) kills the process.

    Built here with a few BPF opcodes, not with libseccomp: the launcher runs `python -I -S`
    without site-packages, and the only pure-Python binding on PyPI (pyseccomp, a ctypes wrapper
    of the system's libseccomp.so, last released in 2021) would add a system library for a
    program of some sixty instructions. tests/test_sandbox.py runs this program through a small
    BPF interpreter for every listed architecture and installs it in a real process.
    """
    if machine not in SECCOMP_ARCHES:
        return None
    arch, numbers = SECCOMP_ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, kill_process, fail = 0x7FFF0000, 0x80000000, 0x00050000  # SECCOMP_RET_ALLOW, _KILL_PROCESS, _ERRNO
    nr_offset, arch_offset, arg0_offset = 0, 4, 16  # struct seccomp_data; arg0's low half (little-endian)
    insns = [(ld, 0, 0, arch_offset), (jeq, 1, 0, arch), (ret, 0, 0, kill_process), (ld, 0, 0, nr_offset)]
    if machine == "x86_64":
        insns += [(jge, 0, 1, 0x40000000), (ret, 0, 0, fail | errno.ENOSYS)]
    for name, nr in numbers.items():
        if name != "clone":
            insns += [(jeq, 0, 1, nr), (ret, 0, 0, fail | (errno.ENOSYS if name == "clone3" else deny_errno))]
    insns += [(jeq, 0, 3, numbers["clone"]), (ld, 0, 0, arg0_offset), (jset, 0, 1, CLONE_NEW_FLAGS),
              (ret, 0, 0, fail | deny_errno), (ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *insn) for insn in insns)

