"""flows/store/lease.py: the store's lease (one computation per cache key across machines), on a local store.

The decisions are pure functions tested with hand-made numbers; the rest uses real processes: two contend for
a key (their compute intervals must not overlap), a holder killed with SIGKILL is taken over after its ttl, and a
holder whose lease was taken over does not delete the new holder's file. Short ttls keep each test ~1-3 s.
The same lease on s3:// is tested in tests/test_s3_store.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flows.store import lease as L
from flows.store.artifacts import ArtifactStore

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def store(tmp_path):
    return ArtifactStore(tmp_path / "store", home=tmp_path / "home")


def _read(store: ArtifactStore, key: str) -> dict | None:
    p = Path(store.base) / "leases" / f"{key}.json"
    return json.loads(p.read_text()) if p.exists() else None


# ---------------------------------------------------------------------------------------------- pure decisions


def test_expiry_decisions():
    assert not L.is_expired(expires_at=100.0, now=99.0)
    assert not L.is_expired(expires_at=100.0, now=100.0)  # exactly at expiry: still held
    assert L.is_expired(expires_at=100.0, now=100.5)
    assert not L.is_expired(expires_at=100.0, now=101.5, skew_s=2.0)  # within the allowed clock skew
    assert L.is_expired(expires_at=100.0, now=102.5, skew_s=2.0)
    assert L.unreadable_expiry(modified_at=50.0, ttl_s=60.0) == 110.0


def test_poll_and_timing_decisions():
    assert L.next_poll_s(expires_at=100.0, now=50.0, poll_s=1.0) == 1.0
    assert L.next_poll_s(expires_at=100.0, now=99.8, poll_s=1.0) == pytest.approx(0.21)  # wake just after expiry
    assert L.next_poll_s(expires_at=100.0, now=99.0, poll_s=1.0, skew_s=2.0) == 1.0
    assert L.next_poll_s(expires_at=100.0, now=200.0, poll_s=1.0) == 0.01  # never a busy loop
    L.check_timing(60, 15, 1)
    L.check_timing(60, 30, 1)
    with pytest.raises(ValueError, match="at most half"):
        L.check_timing(60, 31, 1)
    with pytest.raises(ValueError, match="positive"):
        L.check_timing(0, 1, 1)


def test_still_ours_and_wait_message():
    rec = L.LeaseRecord(key="k", holder="me-1", owner="12-34-abcdef01", host="node-a", pid=12, acquired_at=0.0,
                        expires_at=100.0, ttl_s=60.0)
    assert L.still_ours(rec, "me-1", now=99.0)
    assert not L.still_ours(rec, "me-1", now=101.0)  # expired: a waiter may be taking it over
    assert not L.still_ours(rec, "someone-else", now=50.0)
    assert not L.still_ours(None, "me-1", now=50.0)
    assert L.wait_message(rec, "k") == "waiting for 12-34-abcdef01 on node-a (pid 12) computing k"
    assert L.LeaseRecord.from_bytes(rec.to_bytes()) == rec
    assert L.LeaseRecord.from_bytes(b"{torn") is None


# ---------------------------------------------------------------------------------------------- in one process


def test_acquire_release_and_a_waiter_times_out(store, caplog):
    with L.hold(store, "key1", ttl_s=0.6, renew_every_s=0.15, poll_s=0.05) as held:
        rec = _read(store, "key1")
        assert rec["holder"] == held.holder and rec["pid"] == os.getpid() and rec["host"]
        assert rec["expires_at"] > time.time()
        # held past its first ttl: renewal keeps it (the waiter gives up rather than taking it over)
        with caplog.at_level(logging.INFO, logger="r1flow"), pytest.raises(L.LeaseTimeout, match="still held by"):
            L.Lease(store, "key1", ttl_s=5, renew_every_s=1, poll_s=0.05, skew_s=0, timeout_s=1.2).acquire()
        assert _read(store, "key1")["holder"] == held.holder
        assert _read(store, "key1")["expires_at"] > rec["expires_at"]
        assert not held.lost
    assert [r.message for r in caplog.records if r.message.startswith("waiting for")] == [
        f"waiting for {held.owner} on {held.host} (pid {os.getpid()}) computing key1"]
    assert _read(store, "key1") is None  # released: deleted
    assert sorted(p.name for p in (Path(store.base) / "leases").iterdir()) == []
    with pytest.raises(ValueError, match="key"):
        L.Lease(store, "../escape")


def test_release_after_takeover_keeps_the_new_holders_file(store):
    old = L.Lease(store, "key2", ttl_s=0.4, renew_every_s=0.2, poll_s=0.05, skew_s=0).acquire()
    old._stop.set()  # cut off: it no longer renews (a partition, a long pause)
    old._thread.join()
    new = L.Lease(store, "key2", ttl_s=5, renew_every_s=1, poll_s=0.05, skew_s=0).acquire()
    try:
        assert new.took_over == old.holder and new.waited_s > 0.2
        old.release()
        assert _read(store, "key2")["holder"] == new.holder  # not deleted by the old holder
        old.record = old._new_record(time.time())
        old._stop.clear()
        assert old.renew() is False and old.lost  # the old holder notices at its next renewal
        assert _read(store, "key2")["holder"] == new.holder
    finally:
        new.release()
    assert _read(store, "key2") is None


def test_racing_takeovers_of_one_expired_lease(store):
    """Three threads find the same expired lease: they take turns, never two inside at once."""
    leases = Path(store.base) / "leases"
    leases.mkdir(exist_ok=True)
    dead = L.LeaseRecord(key="key3", holder="dead-1", owner="1-1-00000000", host="gone", pid=1, acquired_at=0.0,
                         expires_at=time.time() - 10, ttl_s=1.0)
    (leases / "key3.json").write_bytes(dead.to_bytes())
    inside, overlaps, took = [], [], []

    def work():
        with L.hold(store, "key3", ttl_s=2, renew_every_s=0.5, poll_s=0.02, skew_s=0) as held:
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(held.holder)
            time.sleep(0.15)
            inside.pop()
            took.append(held.took_over)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert overlaps == [] and len(took) == 3
    # At most one replaced the dead holder's lease. Possibly none by name: in the gap between the winner's delete of
    # the expired file and its create, another waiter's plain create may succeed (the winner then waits its turn).
    assert took.count("dead-1") <= 1 and set(took) <= {"dead-1", None}
    assert sorted(p.name for p in leases.iterdir()) == []  # no leftover lease, token or temporary file


def test_stale_takeover_token_is_cleared(store):
    """A waiter that died mid-takeover left its token: once the token is ttl old, the takeover goes ahead."""
    leases = Path(store.base) / "leases"
    leases.mkdir(exist_ok=True)
    dead = L.LeaseRecord(key="key4", holder="dead-2", owner="1-1-00000000", host="gone", pid=1, acquired_at=0.0,
                         expires_at=time.time() - 10, ttl_s=1.0)
    (leases / "key4.json").write_bytes(dead.to_bytes())
    (leases / "key4.takeover-dead-2.json").write_text(json.dumps({"holder": "x", "created_at": time.time() - 0.5}))
    with L.hold(store, "key4", ttl_s=1.0, renew_every_s=0.5, poll_s=0.05, skew_s=0, timeout_s=5) as held:
        assert held.took_over == "dead-2" and 0.3 < held.waited_s < 3


# ---------------------------------------------------------------------------------------------- real processes

_WORKER = textwrap.dedent("""
    import json, sys, time
    from flows.store.lease import hold
    from flows.store.artifacts import ArtifactStore
    store_root, home, log, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = ArtifactStore(store_root, home=home)
    print("ready", flush=True)
    sys.stdin.readline()  # both start together
    for _ in range(rounds):
        with hold(store, "contended", ttl_s=5, renew_every_s=1, poll_s=0.02, skew_s=0):
            start = time.time()
            time.sleep(0.15)
            end = time.time()
        with open(log, "a") as f:
            f.write(json.dumps([start, end]) + "\\n")
""")

_HOLD_FOREVER = textwrap.dedent("""
    import sys, time
    from flows.store.lease import Lease
    from flows.store.artifacts import ArtifactStore
    lease = Lease(ArtifactStore(sys.argv[1], home=sys.argv[2]), "killed", ttl_s=1.0, renew_every_s=0.25,
                  poll_s=0.05).acquire()
    print(lease.holder, flush=True)
    time.sleep(600)
""")


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def assert_taking_turns(procs: list[subprocess.Popen], log: Path, computations: int) -> list[list[float]]:
    """Start contenders together (each says "ready", then waits for "go"), wait for them, and check that the
    [start, end] intervals they logged never overlap. Returns the intervals, sorted."""
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    intervals = sorted(json.loads(line) for line in log.read_text().splitlines())
    assert len(intervals) == computations
    for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
        assert start >= end, f"overlapping computations: {intervals}"
    return intervals


def test_two_processes_never_compute_at_once(store, tmp_path):
    log = tmp_path / "intervals.jsonl"
    assert_taking_turns([_spawn(_WORKER, store.uri, str(tmp_path / f"home{i}"), str(log), "3") for i in range(2)],
                        log, 6)
    assert _read(store, "contended") is None


def test_a_killed_holder_on_this_host_is_taken_over_at_once(store, tmp_path, caplog):
    """Its process is provably gone (flows.store.artifacts.owner_gone): waiting for the expiry would only waste the ttl. The
    takeover's line says so, not that the lease "expired -0.8 s ago" (its expiry is still ahead)."""
    p = _spawn(_HOLD_FOREVER, store.uri, str(tmp_path / "home-killed"))
    try:
        holder = p.stdout.readline().strip()
        assert _read(store, "killed")["holder"] == holder
        time.sleep(1.2)  # alive and renewing: still held after more than one ttl
        assert _read(store, "killed")["holder"] == holder
        os.kill(p.pid, signal.SIGKILL)
        killed_at = time.time()
        p.wait(timeout=10)
        with caplog.at_level(logging.WARNING, logger="r1flow"), \
                L.hold(store, "killed", ttl_s=30, renew_every_s=5, poll_s=0.05, skew_s=0, timeout_s=10) as held:
            taken = time.time()
            assert held.took_over == holder
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert taken - killed_at < 5, taken - killed_at  # far sooner than the 30 s its last renewal promised
    [line] = [r.message for r in caplog.records if "took over" in r.message]
    assert f"its holder (pid {p.pid} on this host) is gone" in line and "expired" not in line, line


def test_a_silent_holder_on_another_host_is_taken_over_after_its_expiry(store):
    """A holder elsewhere cannot be judged by its pid: only its lease's expiry says it is gone."""
    now = time.time()
    other = L.LeaseRecord(key="remote", holder="4242-99-0badc0de-abc", owner="4242-99-0badc0de", host="elsewhere",
                          pid=4242, acquired_at=now - 5, expires_at=now + 1.0, ttl_s=2)
    leases = Path(store.base) / "leases"
    leases.mkdir(parents=True, exist_ok=True)
    (leases / "remote.json").write_bytes(other.to_bytes())
    assert not L.holder_gone(other)
    with L.hold(store, "remote", ttl_s=2, renew_every_s=0.5, poll_s=0.05, skew_s=0, timeout_s=10) as held:
        taken = time.time()
        assert held.took_over == other.holder
    assert 0.9 <= taken - now <= 3.0, taken - now
