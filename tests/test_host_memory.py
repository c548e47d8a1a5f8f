"""stages.runtime.host_memory: glibc keeps freed blocks for reuse while a CPU stage runs, and only then."""

from __future__ import annotations

import resource
import types

import pytest
import torch

from stages.base import LocalContext
from stages.runtime import host_memory
from stages.training import launch

MIB = 64  # above glibc's largest dynamic mmap threshold (32 MiB): outside the tuning it is always a fresh mmap
PAGES = MIB * 1024 * 1024 // resource.getpagesize()

glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's (Linux); elsewhere it is a no-op")


def _faults(cycles: int = 10) -> int:
    """Minor page faults of allocating, writing and freeing a 64 MiB tensor `cycles` times in a row."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        t = torch.empty(MIB * 1024 * 1024 // 4)
        t.fill_(1.0)
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _clear_user_settings(monkeypatch) -> None:
    for name in ("R1FLOW_MALLOC_TUNING", *host_memory.USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("device", "environ", "wanted"), [
    ("cpu", {}, True),
    ("cpu", {"R1FLOW_MALLOC_TUNING": "1", "GLIBC_TUNABLES": "glibc.rtld.nns=2"}, True),
    ("cuda:0", {}, False),
    ("cuda", {}, False),
    ("cpu", {"R1FLOW_MALLOC_TUNING": "0"}, False),
    ("cpu", {"R1FLOW_MALLOC_TUNING": "false"}, False),
    ("cpu", {"MALLOC_MMAP_THRESHOLD_": "131072"}, False),  # the user's own settings win
    ("cpu", {"MALLOC_TRIM_THRESHOLD_": "0"}, False),
    ("cpu", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, False),
])
def test_tuning_is_for_cpu_stages_the_user_did_not_tune(device, environ, wanted):
    assert host_memory.tuning_wanted(device, environ) is wanted


class FakeLibc:
    """Records the malloc calls; an mmap threshold above `limit` is refused (mallopt(3): 32 MiB on 64-bit)."""

    def __init__(self, limit: int = 1 << 62):
        self.calls, self.limit = [], limit

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return int(param != host_memory.M_MMAP_THRESHOLD or value <= self.limit)

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


RAISE = [("mallopt", host_memory.M_MMAP_THRESHOLD, 1 << 30), ("mallopt", host_memory.M_TRIM_THRESHOLD, 1 << 30)]
RESTORE = [("mallopt", host_memory.M_TRIM_THRESHOLD, 128 * 1024), ("mallopt", host_memory.M_MMAP_THRESHOLD, 128 * 1024),
           ("malloc_trim", 0)]


def test_thresholds_are_raised_inside_and_glibc_defaults_set_again_after(monkeypatch):
    _clear_user_settings(monkeypatch)
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    with host_memory.reuse_freed_memory("cpu") as kept:
        assert kept and libc.calls == RAISE
    assert libc.calls == RAISE + RESTORE


def test_overlapping_stages_restore_when_the_last_one_ends(monkeypatch):
    """Two stages in threads of one process: the first to end must not take the tuning from the other."""
    _clear_user_settings(monkeypatch)
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    with host_memory.reuse_freed_memory("cpu") as first:
        with host_memory.reuse_freed_memory("cpu") as second:
            assert first and second
        assert libc.calls == RAISE
    assert libc.calls == RAISE + RESTORE


def test_an_older_glibc_gets_its_documented_maximum(monkeypatch):
    _clear_user_settings(monkeypatch)
    libc = FakeLibc(limit=32 << 20)
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    with host_memory.reuse_freed_memory("cpu") as kept:
        assert kept
        assert libc.calls == [("mallopt", host_memory.M_MMAP_THRESHOLD, 1 << 30),
                              ("mallopt", host_memory.M_MMAP_THRESHOLD, 32 << 20), RAISE[1]]
    assert libc.calls[3:] == RESTORE


@pytest.mark.parametrize(("device", "environ"), [("cuda:0", {}), ("cpu", {"R1FLOW_MALLOC_TUNING": "0"}),
                                                 ("cpu", {"MALLOC_MMAP_THRESHOLD_": "131072"})])
def test_nothing_is_called_where_tuning_is_not_wanted(monkeypatch, device, environ):
    _clear_user_settings(monkeypatch)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    with host_memory.reuse_freed_memory(device) as kept:
        assert not kept
    assert libc.calls == []


@glibc_only
def test_glibc_reuses_the_freed_pages_inside(monkeypatch):
    """The real effect. With glibc's defaults every 64 MiB block is a fresh mapping, faulted in page by page
    (16,384 faults a cycle with 4 KiB pages); inside, once the heap has settled (the first cycles place the
    block), 10 cycles reuse the same pages: next to no faults."""
    _clear_user_settings(monkeypatch)
    with host_memory.reuse_freed_memory("cpu") as kept:
        assert kept
        _faults()
        inside = _faults()
    assert inside < PAGES // 20, (inside, PAGES)


def test_run_stage_runs_an_in_process_stage_inside_the_tuning(monkeypatch, tmp_path):
    seen = []

    class Recorder:
        def __init__(self, device):
            seen.append(("enter", device))

        def __enter__(self):
            return True

        def __exit__(self, *exc):
            seen.append(("exit",))

    monkeypatch.setattr(launch.host_memory, "reuse_freed_memory", Recorder)
    module = types.SimpleNamespace(__name__="stages.fake", run=lambda cfg, inputs, ctx: seen.append(("run",)) or {})
    launch.run_stage(module, object(), {}, LocalContext(tmp_path, device="cpu"))
    assert seen == [("enter", "cpu"), ("run",), ("exit",)]
