"""stages.host_memory: glibc keeps freed blocks for reuse while a CPU stage runs, and only then."""

from __future__ import annotations

import resource
import types

import pytest
import torch

from stages import host_memory, launch
from stages.base import LocalContext

MIB = 64  # above glibc's largest dynamic mmap threshold (32 MiB): outside the tuning it is always a fresh mmap
PAGES = MIB * 1024 * 1024 // resource.getpagesize()

glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's (Linux); elsewhere it is a no-op")


def _faults_of_one_allocation() -> int:
    """Minor page faults of allocating, writing and freeing one 64 MiB tensor."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(MIB * 1024 * 1024 // 4).fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


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


@glibc_only
def test_freed_memory_is_reused_inside_and_unmapped_again_after(monkeypatch):
    """Inside: the second 64 MiB allocation reuses the first's pages (next to no faults). After: glibc's
    defaults are back, so a 64 MiB block is a fresh mapping again, faulted in page by page."""
    for name in ("R1FLOW_MALLOC_TUNING", *host_memory.USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    outside = _faults_of_one_allocation()
    with host_memory.reuse_freed_memory("cpu") as kept:
        assert kept
        _faults_of_one_allocation()
        inside = _faults_of_one_allocation()
    after = _faults_of_one_allocation()
    assert inside < PAGES // 20, (inside, PAGES)
    if outside > PAGES // 2:  # 4 KiB pages here (a kernel backing it with huge pages faults ~32 times either way)
        assert after > PAGES // 2, (after, PAGES)


@glibc_only
def test_opting_out_changes_nothing(monkeypatch):
    monkeypatch.setenv("R1FLOW_MALLOC_TUNING", "0")
    outside = _faults_of_one_allocation()
    with host_memory.reuse_freed_memory("cpu") as kept:
        assert not kept
        _faults_of_one_allocation()
        inside = _faults_of_one_allocation()
    if outside > PAGES // 2:
        assert inside > PAGES // 2, (inside, PAGES)


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
