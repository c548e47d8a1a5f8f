"""Content-addressed, immutable artifact store on a local directory or any fsspec URI.

Layout under the store root:
    artifacts/<fingerprint>/manifest.json   + the artifact's files
    cache/<cache_key>.json                  which outputs a stage run with that key produced
    artifacts/.incoming-<owner>-<uuid>      an artifact being moved into place (local stores)
    artifacts/.corrupt-<fp>-<ns>-<uuid>     a damaged leftover that a publish moved aside (the newest few kept)
and under the home: tmp/<owner>-<uuid>      a stage's staging folder

<owner> is `<pid>-<start ticks>-<host id>` of the process that made the folder: `sweep()` removes those
whose process is provably gone (another pid, or the same pid with another start time, on this host), so a
run killed with kill -9 leaves nothing behind for good, and a live run's folders are never touched.

Publishing is atomic: files are staged in a temp directory on the same filesystem, the manifest
is written last, and the directory is renamed into place. On object stores (no atomic rename)
the manifest is uploaded last, so an artifact without a manifest is treated as absent.

Object stores (s3://, gs://, ... through fsspec; s3:// is tested against moto's S3 server in
tests/test_s3_store.py) hold weaker guarantees than a POSIX path, and the code relies only on these:
  * one object is written whole or not at all (a PUT), and a read after a write sees it (S3 has been
    strongly read-after-write consistent since 2020): a manifest or cache record is never seen torn;
  * an artifact is several objects: until its manifest (uploaded last) exists, readers treat it as
    absent; a publisher killed mid-upload leaves a manifest-less prefix that the next publish replaces;
  * verify() on a remote store checks that every file in the manifest exists (one listing), not its hash;
    get() downloads and re-hashes every file before a stage sees it;
  * there is no atomic rename or compare-and-swap: the cross-machine lock is flows/store/lease.py's lease, whose
    exclusive create on s3:// is a conditional PUT (If-None-Match: *);
  * listings are not cached (fsspec's directory cache would hide what other machines published after a
    listing, for the life of the process): every lookup asks the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from flows.servers.processes import have_proc, proc_stat
from schemas.artifacts import MANIFEST_FILE, Manifest, Producer
from schemas.errors import ArtifactError, exception_chain
from stages.base import Input

CHUNK = 1 << 20
KEEP_CORRUPT = 3  # set-aside damaged artifacts kept for inspection (the newest); older ones are removed


# ---------------------------------------------------------------------------------------------- process owners
# A folder, a Prefect flow run or an MLflow run names the process that made it; a later run removes or closes it
# only when that process is provably gone. Linux: the pid and its start time (field 22 of /proc/<pid>/stat), so a
# reused pid is not mistaken for the owner. The host id keeps a home shared between machines (or containers with
# their own pid namespace) safe: an owner on another host is never judged.
_OWNER_RE = re.compile(r"^(\d+)-(\d+)-([0-9a-f]{8})-")


_HOST_ID: str | None = None


def host_id() -> str:
    """8 hex characters naming this host and pid namespace (pids mean nothing elsewhere)."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            ns = ""
        _HOST_ID = hashlib.sha256(f"{socket.gethostname()}\0{ns}".encode()).hexdigest()[:8]
    return _HOST_ID


_OWNER: tuple[int, str] | None = None


def process_owner() -> str:
    """`<pid>-<start ticks>-<host id>` of this process (ticks 0 where there is no /proc)."""
    global _OWNER
    pid = os.getpid()
    if _OWNER is None or _OWNER[0] != pid:  # recomputed in a forked child
        st = proc_stat(pid)
        _OWNER = (pid, f"{pid}-{st[2] if st else 0}-{host_id()}")
    return _OWNER[1]


def parse_owner(name: str) -> tuple[int, int, str] | None:
    """(pid, start ticks, host id) from a name that starts with an owner, else None (made before owners)."""
    m = _OWNER_RE.match(name)
    return (int(m[1]), int(m[2]), m[3]) if m else None


def owner_gone(pid: int, ticks: int, host: str) -> bool:
    """True only when the owner is provably gone: on this host, and no process has that pid, or it is a zombie,
    or it started at another time (the pid was reused). Anything uncertain counts as alive."""
    if host != host_id() or pid <= 0:
        return False
    if have_proc():
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return True
        return ticks != 0 and st[2] != ticks
    try:  # no /proc (macOS): only a pid that does not exist at all is gone
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def hash_files(root: Path) -> dict[str, str]:
    """relative posix path -> sha256, for every file under root except the manifest."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not (p.name == MANIFEST_FILE and p.parent == root):
            out[p.relative_to(root).as_posix()] = sha256_file(p)
    return out


def fingerprint_of(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- a full disk
# ENOSPC (or EDQUOT) while an artifact is written reaches us in several shapes: an OSError (errno 28, sometimes
# with the file's name), shutil.Error (copytree's list of (src, dst, message) triples, errno None), safetensors'
# SafetensorError ("I/O error: No space left on device (os error 28)") or pyarrow's OSError with the errno only
# in its text. All become one ArtifactError line naming the path and the store, raised from None.
_DISK_FULL_ERRNOS = {28: "no space left on device", 122: "disk quota exceeded"}  # ENOSPC, EDQUOT
_DISK_FULL_TEXT = {"No space left on device": "no space left on device", "Disk quota exceeded": "disk quota exceeded"}


def _disk_full(exc: BaseException | None) -> tuple[str, str | None] | None:
    """(what, the file being written if known) when exc, or an exception it was raised from, says the disk is full."""
    for link in exception_chain(exc):
        if isinstance(link, shutil.Error) and link.args and isinstance(link.args[0], list):
            for entry in link.args[0]:  # copytree: (src, dst, why) per file that failed
                why = next((w for t, w in _DISK_FULL_TEXT.items() if len(entry) == 3 and t in str(entry[2])), None)
                if why:
                    return why, str(entry[1])
        if isinstance(link, OSError) and link.errno in _DISK_FULL_ERRNOS:
            return _DISK_FULL_ERRNOS[link.errno], link.filename2 or link.filename
        why = next((w for t, w in _DISK_FULL_TEXT.items() if t in str(link)), None)
        if why:
            return why, None
    return None


def raise_if_disk_full(exc: BaseException, writing: str | os.PathLike, store: str) -> None:
    """Raise one ArtifactError line if `exc` is a full disk (or quota) while writing under `writing` for `store`:
    the file (or, where the error does not name it, the folder being written), the store, the space left there
    and what to do. Else return, and the caller re-raises `exc`. The caller has removed what it half wrote."""
    found = _disk_full(exc)
    if found is None:
        return
    why, path = found
    path = str(path or writing)
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:,.1f} MB free there"
    except OSError:
        free = "free space unknown"
    raise ArtifactError(f"{why} writing {path} (store {store}; {free}); nothing was published: free space, or point "
                        f"R1FLOW_HOME (or R1FLOW_STORE) at a larger disk, and run again") from None


@dataclass(frozen=True)
class CacheRecord:
    key: str
    node: str
    stage: str
    outputs: dict[str, str]  # output name -> fingerprint
    mlflow_run_id: str | None
    duration_s: float
    metrics: dict[str, float]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True)


class ArtifactStore:
    def __init__(self, root: str | os.PathLike, home: str | os.PathLike | None = None):
        self.uri = str(root)
        self.fs, base = fsspec.core.url_to_fs(self.uri)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if not self.is_local:  # a cached listing would hide what other machines publish (see the docstring)
            self.fs, base = fsspec.core.url_to_fs(self.uri, use_listings_cache=False)
        self.base = base.rstrip("/")
        # Local working space (staging, checkpoints, downloads of remote artifacts).
        self.home = Path(home) if home is not None else (Path(self.base) if self.is_local else Path(".r1flow"))
        for d in ("tmp", "checkpoints", "remote-cache"):
            (self.home / d).mkdir(parents=True, exist_ok=True)
        self.fs.makedirs(f"{self.base}/artifacts", exist_ok=True)
        self.fs.makedirs(f"{self.base}/cache", exist_ok=True)

    # ------------------------------------------------------------------ paths
    def artifact_path(self, fingerprint: str) -> str:
        return f"{self.base}/artifacts/{fingerprint}"

    def new_staging_dir(self) -> Path:
        path = self.home / "tmp" / f"{process_owner()}-{uuid.uuid4().hex}"
        path.mkdir(parents=True)
        return path

    def checkpoint_dir(self, cache_key: str) -> Path:
        return self.home / "checkpoints" / cache_key

    # ------------------------------------------------------------------ publish
    def publish(
        self,
        staged: Path,
        *,
        kind: str,
        schema: str,
        producer: Producer,
        parents: list[str],
        rows: int | None = None,
        metrics: dict[str, float] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Move a staged directory into the store; return its manifest. Idempotent on content."""
        staged = Path(staged)
        (staged / MANIFEST_FILE).unlink(missing_ok=True)
        # JSON has no NaN/inf (pydantic writes null, which a float field cannot read back: the manifest, and the
        # artifact with it, would be unreadable). A metric that is undefined (an eval with nothing scored) is left
        # out and named in extra; a diverged loss never gets here (stages.base.check_finite_losses stops the stage).
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        undefined = {k: str(v) for k, v in metrics.items() if not math.isfinite(v)}
        if undefined:
            metrics = {k: v for k, v in metrics.items() if k not in undefined}
            extra = {**(extra or {}), "non_finite_metrics": undefined}
        files = hash_files(staged)
        if not files:
            raise ArtifactError(f"{staged}: refusing to publish an empty artifact")
        fp = fingerprint_of(files)
        manifest = Manifest(
            kind=kind, schema=schema, fingerprint=fp, files=files, rows=rows, producer=producer,
            parents=list(parents), metrics=metrics,
            extra=dict(extra or {}),
        ).sealed()
        try:
            existing = self.verify(fp)
        except ArtifactError:
            existing = None
        if existing is not None:  # same bytes already stored: keep the first, immutable copy
            shutil.rmtree(staged, ignore_errors=True)
            return existing
        final = self.artifact_path(fp)
        if self.is_local:
            # Move next to the final place first (may cross filesystems), manifest last, then one rename.
            incoming = f"{self.base}/artifacts/.incoming-{process_owner()}-{uuid.uuid4().hex}"
            try:
                shutil.move(str(staged), incoming)
                Path(incoming, MANIFEST_FILE).write_text(manifest.to_json())
                set_aside = os.path.exists(final)
                if set_aside:  # an incomplete or corrupt leftover: move it aside, never overwrite in place
                    os.replace(final, f"{self.base}/artifacts/.corrupt-{fp[:12]}-{time.time_ns()}-{uuid.uuid4().hex[:6]}")
                os.replace(incoming, final)
            except BaseException as e:
                shutil.rmtree(incoming, ignore_errors=True)
                raise_if_disk_full(e, incoming, self.uri)
                raise
            if set_aside:
                self._cap_corrupt()
        else:
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            for rel in files:
                self.fs.put_file(str(staged / rel), f"{final}/{rel}")
            with self.fs.open(f"{final}/{MANIFEST_FILE}", "w") as f:
                f.write(manifest.to_json())
            shutil.rmtree(staged, ignore_errors=True)
        return manifest

    # ------------------------------------------------------------------ litter
    def sweep(self, keep_corrupt: int = KEEP_CORRUPT) -> dict[str, int]:
        """Remove what killed runs left: staging folders and `.incoming-*` folders whose owner process is provably
        gone (a live run's are never touched: see owner_gone), and set-aside `.corrupt-*` copies beyond the newest
        `keep_corrupt`. One listing of the home's tmp/ and one of the store's artifacts/. Returns counts."""
        counts = {"staging": 0, "incoming": 0, "corrupt": 0}
        verdicts: dict[tuple[int, int, str], bool] = {}

        def gone(name: str) -> bool:
            owner = parse_owner(name)
            if owner is None:  # made before folders named their owner: nothing proves it is abandoned
                return False
            if owner not in verdicts:
                verdicts[owner] = owner_gone(*owner)
            return verdicts[owner]

        try:
            staging = list(os.scandir(self.home / "tmp"))
        except FileNotFoundError:
            staging = []
        for entry in staging:
            if gone(entry.name):
                shutil.rmtree(entry.path, ignore_errors=True)
                counts["staging"] += 1
        if self.is_local:
            for entry in self._hidden_entries(".incoming-"):
                if gone(entry.name.removeprefix(".incoming-")):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    counts["incoming"] += 1
            counts["corrupt"] = self._cap_corrupt(keep_corrupt)
        return counts

    def _hidden_entries(self, prefix: str) -> list[os.DirEntry]:
        try:
            return [e for e in os.scandir(f"{self.base}/artifacts") if e.name.startswith(prefix)]
        except FileNotFoundError:
            return []

    def _cap_corrupt(self, keep: int = KEEP_CORRUPT) -> int:
        """Keep the newest `keep` set-aside copies (by the time in their name; older names: when set aside)."""

        def when(entry: os.DirEntry) -> int:
            parts = entry.name.split("-")
            if len(parts) == 4 and parts[2].isdigit():
                return int(parts[2])
            try:
                return entry.stat(follow_symlinks=False).st_ctime_ns  # a rename sets ctime
            except OSError:
                return 0

        copies = sorted(self._hidden_entries(".corrupt-"), key=when, reverse=True)
        for entry in copies[keep:]:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        return len(copies[keep:])

    # ------------------------------------------------------------------ read
    def read_manifest(self, fingerprint: str) -> Manifest:
        path = f"{self.artifact_path(fingerprint)}/{MANIFEST_FILE}"
        try:
            with self.fs.open(path, "r") as f:
                return Manifest.model_validate_json(f.read())
        except FileNotFoundError:
            raise ArtifactError(f"artifact {fingerprint[:12]}: not in store {self.uri} (no {MANIFEST_FILE})") from None
        except ValueError as e:
            raise ArtifactError(f"artifact {fingerprint[:12]}: unreadable manifest ({e})") from None

    def local_dir(self, fingerprint: str) -> Path:
        if self.is_local:
            return Path(self.artifact_path(fingerprint))
        return self.home / "remote-cache" / fingerprint

    def verify(self, fingerprint: str) -> Manifest:
        """Check the manifest is as published (its digest) and the artifact holds exactly its files, each matching
        its recorded hash. Raises ArtifactError naming the artifact and the problem."""
        manifest = self.read_manifest(fingerprint)
        what = f"artifact {fingerprint[:12]}"
        if manifest.fingerprint != fingerprint or fingerprint_of(manifest.files) != fingerprint:
            raise ArtifactError(f"{what}: manifest does not match its fingerprint")
        if manifest.digest is not None and manifest.digest != manifest.content_digest():
            raise ArtifactError(f"{what}: {MANIFEST_FILE} was edited after it was published (its fields no longer "
                                "match its digest)")
        root = self.artifact_path(fingerprint)
        present = self._files_in(root)
        for rel in manifest.files:
            if rel not in present:
                raise ArtifactError(f"{what}: file {rel} is missing" + ("" if self.is_local else f" in {self.uri}"))
        extra = sorted(present - set(manifest.files))
        if extra:
            raise ArtifactError(f"{what}: file {extra[0]} is not in its manifest"
                                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        if self.is_local:  # remote stores: existence here, hashes when downloaded (get)
            for rel, digest in manifest.files.items():
                if sha256_file(Path(root) / rel) != digest:
                    raise ArtifactError(f"{what}: file {rel} does not match its hash")
        return manifest

    def _files_in(self, root: str) -> set[str]:
        """Every file under an artifact's folder but its manifest, as relative posix paths."""
        if self.is_local:
            base = Path(root)
            return {p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file() or p.is_symlink()} - {
                MANIFEST_FILE}
        try:
            return {p.removeprefix(f"{root}/") for p in self.fs.find(root)} - {MANIFEST_FILE}
        except FileNotFoundError:
            return set()

    def is_valid(self, fingerprint: str) -> bool:
        try:
            self.verify(fingerprint)
            return True
        except ArtifactError:
            return False

    def get(self, fingerprint: str) -> Input:
        """Verified local view of an artifact (downloaded first when the store is remote)."""
        manifest = self.verify(fingerprint)
        if not self.is_local:
            local = self.local_dir(fingerprint)
            if not (local / MANIFEST_FILE).exists() or hash_files(local) != manifest.files:
                tmp = self.new_staging_dir()
                for rel in manifest.files:
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(f"{self.artifact_path(fingerprint)}/{rel}", str(tmp / rel))
                if hash_files(tmp) != manifest.files:
                    raise ArtifactError(f"artifact {fingerprint[:12]}: downloaded files do not match their hashes")
                (tmp / MANIFEST_FILE).write_text(manifest.to_json())
                shutil.rmtree(local, ignore_errors=True)
                try:
                    os.replace(tmp, local)
                except OSError:  # another process of this home downloaded it meanwhile: use theirs if whole
                    shutil.rmtree(tmp, ignore_errors=True)
                    if hash_files(local) != manifest.files:
                        raise ArtifactError(f"artifact {fingerprint[:12]}: the download in {local} does not "
                                            "match its hashes") from None
            return Input(local, manifest)
        return Input(Path(self.artifact_path(fingerprint)), manifest)

    def resolve_prefix(self, prefix: str) -> str:
        """Full fingerprint from a unique prefix (as shown by `r1flow artifacts`)."""
        matches = [n for n in self._artifact_names() if n.startswith(prefix)]
        if not matches:
            raise ArtifactError(f"no artifact with fingerprint starting {prefix!r} in {self.uri}")
        if len(matches) > 1:
            raise ArtifactError(f"fingerprint prefix {prefix!r} is ambiguous ({len(matches)} artifacts)")
        return matches[0]

    def _artifact_names(self) -> list[str]:
        """Every artifact directory's name; incoming and set-aside directories (names starting with '.') are not
        artifacts."""
        try:
            listed = self.fs.ls(f"{self.base}/artifacts", detail=False)
        except FileNotFoundError:  # an object store has no empty folders: nothing published yet
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in listed)
        return sorted(n for n in names if n and not n.startswith("."))

    def verify_all(self) -> list[tuple[str, str | None]]:
        """(name, None if it verifies else why not) for every artifact directory, those without a manifest
        included (incomplete or damaged)."""
        out = []
        for name in self._artifact_names():
            try:
                self.verify(name)
                out.append((name, None))
            except ArtifactError as e:
                out.append((name, str(e)))
        return out

    def scan(self) -> tuple[list[Manifest], list[str]]:
        """(the manifests, oldest first; the directories without a readable manifest: incomplete or damaged)."""
        manifests, unreadable = [], []
        for name in self._artifact_names():
            try:
                manifests.append(self.read_manifest(name))
            except ArtifactError:
                unreadable.append(name)
        return sorted(manifests, key=lambda m: m.created_at), unreadable

    def unreadable(self) -> list[str]:
        """Artifact directories without a readable manifest (incomplete or damaged); `list` leaves them out."""
        return self.scan()[1]

    def list(self) -> list[Manifest]:
        return self.scan()[0]

    # ------------------------------------------------------------------ stage cache
    def _cache_path(self, key: str) -> str:
        return f"{self.base}/cache/{key}.json"

    def record(self, rec: CacheRecord) -> None:
        path = self._cache_path(rec.key)
        if self.is_local:
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            try:
                Path(tmp).write_text(rec.to_json())
                os.replace(tmp, path)
            except BaseException as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise_if_disk_full(e, tmp, self.uri)
                raise
        else:
            with self.fs.open(path, "w") as f:
                f.write(rec.to_json())

    def lookup(self, key: str, damaged: list[tuple[str, str]] | None = None) -> CacheRecord | None:
        """The record for `key` if all its outputs still exist and verify. `damaged`, when given, receives (output
        name, why) for each output of a record that does not: why a stage with a record is computed again."""
        try:
            with self.fs.open(self._cache_path(key), "r") as f:
                rec = CacheRecord(**json.loads(f.read()))
        except (FileNotFoundError, ValueError, TypeError):
            return None
        problems = []
        for name, fp in rec.outputs.items():
            try:
                self.verify(fp)
            except ArtifactError as e:
                problems.append((name, str(e)))
        if damaged is not None:
            damaged.extend(problems)
        return None if problems else rec
