"""Content-addressed, immutable artifact store on a local directory or any fsspec URI.

Layout under the store root:
    artifacts/<fingerprint>/manifest.json   + the artifact's files
    cache/<cache_key>.json                  which outputs a stage run with that key produced

Publishing is atomic: files are staged in a temp directory on the same filesystem, the manifest
is written last, and the directory is renamed into place. On object stores (no atomic rename)
the manifest is uploaded last, so an artifact without a manifest is treated as absent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from schemas.artifacts import MANIFEST_FILE, Manifest, Producer
from schemas.errors import ArtifactError
from stages.base import Input

CHUNK = 1 << 20


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
        path = self.home / "tmp" / uuid.uuid4().hex
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
        )
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
            incoming = f"{self.base}/artifacts/.incoming-{uuid.uuid4().hex}"
            shutil.move(str(staged), incoming)
            Path(incoming, MANIFEST_FILE).write_text(manifest.to_json())
            if os.path.exists(final):  # an incomplete or corrupt leftover: move it aside, never overwrite in place
                os.replace(final, f"{self.base}/artifacts/.corrupt-{fp[:12]}-{uuid.uuid4().hex[:6]}")
            os.replace(incoming, final)
        else:
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            for rel in files:
                self.fs.put_file(str(staged / rel), f"{final}/{rel}")
            with self.fs.open(f"{final}/{MANIFEST_FILE}", "w") as f:
                f.write(manifest.to_json())
            shutil.rmtree(staged, ignore_errors=True)
        return manifest

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
        """Check every file exists and matches its recorded hash. Raises ArtifactError."""
        manifest = self.read_manifest(fingerprint)
        if manifest.fingerprint != fingerprint or fingerprint_of(manifest.files) != fingerprint:
            raise ArtifactError(f"artifact {fingerprint[:12]}: manifest does not match its fingerprint")
        if self.is_local:
            root = Path(self.artifact_path(fingerprint))
            for rel, digest in manifest.files.items():
                p = root / rel
                if not p.is_file():
                    raise ArtifactError(f"artifact {fingerprint[:12]}: file {rel} is missing")
                if sha256_file(p) != digest:
                    raise ArtifactError(f"artifact {fingerprint[:12]}: file {rel} does not match its hash")
        else:
            for rel in manifest.files:
                if not self.fs.exists(f"{self.artifact_path(fingerprint)}/{rel}"):
                    raise ArtifactError(f"artifact {fingerprint[:12]}: file {rel} is missing in {self.uri}")
        return manifest

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
                os.replace(tmp, local)
            return Input(local, manifest)
        return Input(Path(self.artifact_path(fingerprint)), manifest)

    def resolve_prefix(self, prefix: str) -> str:
        """Full fingerprint from a unique prefix (as shown by `r1flow artifacts`)."""
        names = [Path(p).name for p in self.fs.ls(f"{self.base}/artifacts", detail=False)]
        matches = [n for n in names if n.startswith(prefix) and not n.startswith(".")]
        if not matches:
            raise ArtifactError(f"no artifact with fingerprint starting {prefix!r} in {self.uri}")
        if len(matches) > 1:
            raise ArtifactError(f"fingerprint prefix {prefix!r} is ambiguous ({len(matches)} artifacts)")
        return matches[0]

    def _artifact_names(self) -> list[str]:
        """Every artifact directory's name; incoming and set-aside directories (names starting with '.') are not
        artifacts."""
        names = (Path(p).name for p in self.fs.ls(f"{self.base}/artifacts", detail=False))
        return sorted(n for n in names if not n.startswith("."))

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
            Path(tmp).write_text(rec.to_json())
            os.replace(tmp, path)
        else:
            with self.fs.open(path, "w") as f:
                f.write(rec.to_json())

    def lookup(self, key: str) -> CacheRecord | None:
        """The record for `key` if all its outputs still exist and match their fingerprints."""
        try:
            with self.fs.open(self._cache_path(key), "r") as f:
                rec = CacheRecord(**json.loads(f.read()))
        except (FileNotFoundError, ValueError, TypeError):
            return None
        if all(self.is_valid(fp) for fp in rec.outputs.values()):
            return rec
        return None
