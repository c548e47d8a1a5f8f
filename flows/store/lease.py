"""A lease in the shared artifact store: one computation per cache key across machines.

`stage_lock` (flows/run/pipeline.py) is an fcntl lock: it serialises the processes of ONE machine. Machines that
share a store (an NFS path or an object store URI) need a lock that lives in the store itself and that dies with
its holder. This is a lease (as in Marin's executor): a small JSON file

    <store>/leases/<key>.json   {"key", "holder", "owner", "host", "pid", "acquired_at", "expires_at", "ttl_s"}

written by an atomic create. `holder` is `process_owner()` (flows/store/artifacts.py) plus a uuid: unique to one hold.
While held, a daemon thread pushes `expires_at` (wall clock, seconds since the epoch) `ttl_s` ahead every
`renew_every_s`. A waiter polls; once `expires_at` (plus `skew_s` for clocks that disagree between machines) has
passed, the holder is taken to be dead or cut off, and the lease is taken over. Release deletes the file only
while it is still ours and unexpired.

Takeover without a compare-and-delete: a waiter that finds lease L expired first wins a takeover token
`leases/<key>.takeover-<L's holder>.json` with the same atomic create; only the winner deletes L (after reading
it again: still L) and creates its own lease. So two waiters never both replace the same expired lease. A token
left by a waiter that died mid-takeover is removed once it is `ttl_s` old.

Guarantees, by store:
  * local or NFS path: the create is `link(2)` of a fully written temporary file onto the lease name, which fails
    if the name exists (atomic on local filesystems and NFSv3+, the classic NFS lock-file technique; where
    hard links are not supported, `O_CREAT|O_EXCL`). Exclusive.
  * s3:// (s3fs): `put_object` with `If-None-Match: *` (s3fs `pipe_file(mode="create")`), then read back. AWS
    S3 (since 2024-08), MinIO and moto honour it: exclusive. A server that ignores the header makes it
    last-writer-wins; the read-back then catches all but near-simultaneous creates.
  * any other fsspec store: check-then-write, then read back after `settle_s`: NOT exclusive, only unlikely to
    race (two waiters must create within `settle_s` of each other).
In every case the lease is time based: a holder that is alive but cannot renew for `ttl_s` (a long pause, a
network partition, a clock that jumps) loses it, and another machine may start the same computation. The old
holder notices at its next renewal (`Lease.lost`, logged) but its computation is not interrupted; publishing is
content-addressed and idempotent, so the cost is a duplicate computation, never a corrupt artifact. Renewal and
release read, check "still ours", then write or delete: not a compare-and-swap, which is safe because nobody else
touches a lease before it has expired.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from flows.store.artifacts import ArtifactStore, owner_gone, parse_owner, process_owner
from schemas.errors import R1FlowError

LEASES = "leases"
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


class LeaseTimeout(R1FlowError):
    """Waited `timeout_s` for a lease that another holder kept renewing."""


@dataclass(frozen=True)
class LeaseRecord:
    key: str
    holder: str  # process_owner() + "-" + uuid: one hold
    owner: str  # process_owner() of the holding process
    host: str
    pid: int
    acquired_at: float
    expires_at: float
    ttl_s: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> LeaseRecord | None:
        try:
            d = json.loads(raw)
            return cls(key=str(d["key"]), holder=str(d["holder"]), owner=str(d["owner"]), host=str(d["host"]),
                       pid=int(d["pid"]), acquired_at=float(d["acquired_at"]), expires_at=float(d["expires_at"]),
                       ttl_s=float(d["ttl_s"]))
        except (ValueError, KeyError, TypeError):
            return None


# ---------------------------------------------------------------------------------------------- pure decisions


def check_timing(ttl_s: float, renew_every_s: float, poll_s: float) -> None:
    """A holder must renew at least twice per ttl (one renewal may be slow or fail) and a waiter poll > 0."""
    if not (ttl_s > 0 and renew_every_s > 0 and poll_s > 0):
        raise ValueError(f"lease timings must be positive (ttl_s={ttl_s}, renew_every_s={renew_every_s}, "
                         f"poll_s={poll_s})")
    if renew_every_s * 2 > ttl_s:
        raise ValueError(f"renew_every_s={renew_every_s} must be at most half of ttl_s={ttl_s}: a lease renewed "
                         "less often expires under a live holder after one slow renewal")


def is_expired(expires_at: float, now: float, skew_s: float = 0.0) -> bool:
    """A lease is taken over only once its expiry plus the allowed clock skew has passed."""
    return now > expires_at + skew_s


def unreadable_expiry(modified_at: float, ttl_s: float) -> float:
    """Expiry of a lease file that exists but cannot be parsed (torn or foreign): its modification time + ttl."""
    return modified_at + ttl_s


def next_poll_s(expires_at: float, now: float, poll_s: float, skew_s: float = 0.0) -> float:
    """How long a waiter sleeps: poll_s, or less when the lease expires sooner (never under 10 ms)."""
    return max(0.01, min(poll_s, expires_at + skew_s - now + 0.01))


def still_ours(record: LeaseRecord | None, holder: str, now: float) -> bool:
    """May this holder renew or delete the lease? Only its own record, and only before it expired (afterwards a
    waiter may be taking it over)."""
    return record is not None and record.holder == holder and not is_expired(record.expires_at, now)


def holder_gone(record: LeaseRecord | None) -> bool:
    """The holder is a process on this host that is provably gone (kill -9, a lost Ray worker on a machine that
    runs several nodes): no need to wait for its lease to expire. Holders on other hosts are judged by expiry."""
    parsed = parse_owner(f"{record.owner}-") if record is not None else None
    return parsed is not None and owner_gone(*parsed)


def takeover_message(key: str, stale: LeaseRecord | None, stale_expiry: float, now: float) -> str:
    """Why a lease was taken over: it expired, or (before its expiry) its holder is a process of this host that is
    gone (`holder_gone`)."""
    whose = f"{stale.owner} on {stale.host}" if stale else "an unreadable lease"
    if now > stale_expiry:
        return f"lease {key}: took over from {whose}, expired {now - stale_expiry:.1f} s ago"
    return (f"lease {key}: took over from {whose}: its holder (pid {stale.pid} on this host) is gone, "
            f"{stale_expiry - now:.1f} s before its lease ran out")


def wait_message(record: LeaseRecord | None, key: str) -> str:
    if record is None:
        return f"waiting for an unknown holder (unreadable lease) computing {key}"
    return f"waiting for {record.owner} on {record.host} (pid {record.pid}) computing {key}"


# ---------------------------------------------------------------------------------------------- storage


def _synced_temp(path: str, data: bytes) -> str:
    """`data` in a new temporary file beside `path`, on disk (fsync'ed): ready to be linked or renamed onto it."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


class _Files:
    """create-exclusive, read, overwrite, delete of small files under the store's leases/ folder."""

    def __init__(self, store: ArtifactStore, settle_s: float):
        self.store = store
        self.fs = store.fs
        self.root = f"{store.base}/{LEASES}"
        self.settle_s = settle_s
        self.local = store.is_local
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.exclusive_remote = proto in ("s3", "s3a")  # s3fs: put_object with If-None-Match: *
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)
        else:
            self.fs.makedirs(self.root, exist_ok=True)

    @property
    def exclusive(self) -> bool:
        return self.local or self.exclusive_remote

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def create(self, name: str, data: bytes) -> bool:
        """Create `name` with `data` unless it exists. True if this call created it."""
        path = self.path(name)
        if self.local:
            tmp = _synced_temp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError:  # no hard links here: O_EXCL (a reader may see it empty: see unreadable_expiry)
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return True
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        if not self.exclusive_remote:
            time.sleep(self.settle_s)  # let a racing writer's overwrite land before reading back
        return self.read(name)[0] == data

    def read(self, name: str) -> tuple[bytes | None, float | None]:
        """(content, modification time), (None, None) when there is no such file."""
        path = self.path(name)
        if self.local:
            try:
                with open(path, "rb") as f:
                    return f.read(), os.fstat(f.fileno()).st_mtime
            except FileNotFoundError:
                return None, None
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None, None
        try:
            mtime = self.fs.modified(path).timestamp()
        except (FileNotFoundError, NotImplementedError, OSError, AttributeError):
            mtime = time.time()
        return data, mtime

    def overwrite(self, name: str, data: bytes) -> None:
        path = self.path(name)
        if self.local:
            os.replace(_synced_temp(path, data), path)
        else:
            self.fs.pipe_file(path, data)

    def delete(self, name: str) -> None:
        path = self.path(name)
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)


# ---------------------------------------------------------------------------------------------- the lease


class Lease:
    """One hold of `<store>/leases/<key>.json`. `acquire()` waits (polling) until it holds the lease; `release()`
    stops the renewal thread and deletes the file if it is still ours. Also a context manager."""

    def __init__(self, store: ArtifactStore, key: str, *, ttl_s: float = 60, renew_every_s: float = 15,
                 poll_s: float = 1.0, skew_s: float = 2.0, settle_s: float = 1.0,
                 log: logging.Logger | logging.LoggerAdapter | None = None, timeout_s: float | None = None):
        if not _KEY_RE.match(key):
            raise ValueError(f"lease key {key!r}: letters, digits, '.', '_' and '-' only")
        check_timing(ttl_s, renew_every_s, poll_s)
        self.key, self.ttl_s, self.renew_every_s, self.poll_s = key, ttl_s, renew_every_s, poll_s
        self.skew_s, self.timeout_s = skew_s, timeout_s
        self.log = log or logging.getLogger("r1flow")
        self.files = _Files(store, settle_s)
        self.name = f"{key}.json"
        self.owner = process_owner()
        self.holder = f"{self.owner}-{uuid.uuid4().hex[:12]}"
        self.host = socket.gethostname()
        self.record: LeaseRecord | None = None
        self.lost = False  # set by the renewal thread when another holder took the lease over
        self.waited_s = 0.0
        self.took_over: str | None = None  # the holder of the expired lease this one replaced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()  # renewal vs release

    @property
    def path(self) -> str:
        return self.files.path(self.name)

    def _new_record(self, now: float) -> LeaseRecord:
        acquired = self.record.acquired_at if self.record else now
        return LeaseRecord(key=self.key, holder=self.holder, owner=self.owner, host=self.host, pid=os.getpid(),
                           acquired_at=acquired, expires_at=now + self.ttl_s, ttl_s=self.ttl_s)

    def _current(self) -> tuple[LeaseRecord | None, float | None, bool]:
        """(record or None, its expiry, whether a file exists)."""
        raw, mtime = self.files.read(self.name)
        if raw is None:
            return None, None, False
        rec = LeaseRecord.from_bytes(raw)
        if rec is not None:
            return rec, rec.expires_at, True
        return None, unreadable_expiry(mtime or time.time(), self.ttl_s), True

    def try_acquire(self) -> bool:
        """One attempt: create the lease, or take over an expired one. True when held."""
        now = time.time()
        rec = self._new_record(now)
        if self.files.create(self.name, rec.to_bytes()):
            self.record = rec
            return True
        current, expires_at, exists = self._current()
        if not exists:  # released between our create and our read: try again at once
            return self._create_now()
        if current is not None and current.holder == self.holder:  # a read-back after a slow create
            self.record = current
            return True
        if not (is_expired(expires_at, time.time(), self.skew_s) or holder_gone(current)):
            return False
        return self._take_over(current, expires_at)

    def _create_now(self) -> bool:
        rec = self._new_record(time.time())
        if self.files.create(self.name, rec.to_bytes()):
            self.record = rec
            return True
        return False

    def _take_over(self, stale: LeaseRecord | None, stale_expiry: float) -> bool:
        stale_id = stale.holder if stale is not None else f"unreadable-{int(stale_expiry)}"
        token = f"{self.key}.takeover-{stale_id}.json"
        now = time.time()
        mine = json.dumps({"holder": self.holder, "created_at": now}).encode()
        if not self.files.create(token, mine):
            raw, mtime = self.files.read(token)
            try:
                created = float(json.loads(raw)["created_at"]) if raw is not None else None
            except (ValueError, KeyError, TypeError):
                created = mtime
            if created is not None and is_expired(created + self.ttl_s, now, self.skew_s):
                self.files.delete(token)  # its writer died mid-takeover; the next poll tries again
            return False
        try:
            again, expiry_again, exists = self._current()
            if exists:
                same = again.holder == stale.holder if (again and stale) else (again is None and stale is None)
                if not (same and (is_expired(expiry_again, time.time(), self.skew_s) or holder_gone(again))):
                    return False  # renewed or replaced meanwhile
                self.files.delete(self.name)
            if self._create_now():
                self.took_over = stale_id
                self.log.warning(takeover_message(self.key, stale, stale_expiry, time.time()))
                return True
            return False
        finally:
            self.files.delete(token)

    def acquire(self) -> Lease:
        t0 = time.monotonic()
        announced: str | None = None
        while not self.try_acquire():
            current, expires_at, _ = self._current()
            msg = wait_message(current, self.key)
            if msg != announced:
                self.log.info(msg)
                announced = msg
            if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                raise LeaseTimeout(f"lease {self.key}: gave up after {self.timeout_s:.0f} s; "
                                   f"{msg.replace('waiting for', 'still held by')} (lease file {self.path})")
            now = time.time()
            time.sleep(next_poll_s(expires_at if expires_at is not None else now, now, self.poll_s, self.skew_s))
        self.waited_s = time.monotonic() - t0
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.key[:12]}", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                if not self.renew():
                    return
            except Exception as e:  # a store hiccup: try again next time; expiry decides
                self.log.warning(f"lease {self.key}: renewal failed ({e}); retrying in {self.renew_every_s} s")

    def renew(self) -> bool:
        """Push expires_at ttl ahead if the lease is still ours; else mark it lost. True while held."""
        with self._mutex:
            if self._stop.is_set() or self.record is None:
                return False
            current, _, _ = self._current()
            if not still_ours(current, self.holder, time.time()):
                self.lost = True
                who = f"{current.owner} on {current.host}" if current else "nobody (deleted)"
                self.log.warning(f"lease {self.key}: lost (now held by {who}); this computation is no longer "
                                 "exclusive")
                return False
            rec = self._new_record(time.time())
            self.files.overwrite(self.name, rec.to_bytes())
            self.record = rec
            return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._mutex:
            if self.record is None:
                return
            current, _, _ = self._current()
            if still_ours(current, self.holder, time.time()):
                self.files.delete(self.name)
            self.record = None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold(store: ArtifactStore, key: str, *, ttl_s: float = 60, renew_every_s: float = 15, poll_s: float = 1.0,
         skew_s: float = 2.0, log: logging.Logger | logging.LoggerAdapter | None = None,
         timeout_s: float | None = None) -> Iterator[Lease]:
    """Hold the store's lease for `key` for the duration of the block (waiting for another holder first)."""
    lease = Lease(store, key, ttl_s=ttl_s, renew_every_s=renew_every_s, poll_s=poll_s, skew_s=skew_s, log=log,
                  timeout_s=timeout_s)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()
