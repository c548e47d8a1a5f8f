"""flows/store/artifacts.py's s3:// branch and flows/store/lease.py on s3://, against moto's S3 server on 127.0.0.1.

This is how s3fs tests itself: a real S3 HTTP endpoint (moto's server) on a local port, with dummy
credentials, rather than mocked client calls; everything below goes through s3fs, aiobotocore and HTTP. The
store takes only a URI (`R1FLOW_STORE=s3://bucket/prefix`), so the endpoint comes from the environment:
botocore (>= 1.31) reads AWS_ENDPOINT_URL whenever a client is made (s3fs 2026.9 honours it: it passes no
endpoint of its own when none is configured). fsspec's FSSPEC_S3_ENDPOINT_URL works too, but fsspec reads it
once, at import, so it is no use to a test that starts its server later.

One server per module (~1 s to start); each test uses a bucket of its own.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from flows.store import lease as L  # noqa: E402
from flows.store.artifacts import ArtifactStore, CacheRecord, hash_files  # noqa: E402
from schemas.artifacts import MANIFEST_FILE, Producer  # noqa: E402
from schemas.errors import ArtifactError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRODUCER = Producer(stage="t", stage_version="1", config_hash="h")


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture()
def s3_env(s3_endpoint, monkeypatch):
    import s3fs

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made before the endpoint was set
    yield {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3_endpoint}
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture()
def uri(s3_env):
    return f"s3://r1flow-{uuid.uuid4().hex[:10]}/team/store"


def _stage(store: ArtifactStore, files: dict[str, str]) -> Path:
    d = store.new_staging_dir()
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def _other_machine(uri: str, tmp_path: Path, name: str) -> ArtifactStore:
    """Another process's view of the same store: its own s3fs instance (no shared caches) and home."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return ArtifactStore(uri, home=tmp_path / name)


def test_publish_verify_get_and_list(uri, tmp_path):
    store = ArtifactStore(uri, home=tmp_path / "home-a")
    assert not store.is_local and store.base.endswith("/team/store")
    assert store.list() == [] and store.unreadable() == []  # an empty prefix: no "folders" on S3
    m = store.publish(_stage(store, {"data.txt": "rows", "sub/weights.bin": "w" * 1000}), kind="dataset",
                      schema="sft", producer=PRODUCER, parents=[], rows=2, metrics={"acc": 0.5})
    assert not any((tmp_path / "home-a" / "tmp").iterdir())  # staging removed after upload
    keys = sorted(p.removeprefix(f"{store.artifact_path(m.fingerprint)}/")
                  for p in store.fs.find(store.artifact_path(m.fingerprint)))
    assert keys == sorted([MANIFEST_FILE, "data.txt", "sub/weights.bin"])

    # another machine: sees it without any listing cache, downloads and re-hashes it
    other = _other_machine(uri, tmp_path, "home-b")
    assert other.verify(m.fingerprint).rows == 2
    got = other.get(m.fingerprint)
    assert got.path == tmp_path / "home-b" / "remote-cache" / m.fingerprint
    assert hash_files(got.path) == m.files and (got.path / "sub" / "weights.bin").read_text() == "w" * 1000
    assert other.get(m.fingerprint).path == got.path  # a second get reuses the verified download
    assert [x.fingerprint for x in other.list()] == [m.fingerprint]
    assert other.resolve_prefix(m.fingerprint[:8]) == m.fingerprint
    again = other.publish(_stage(other, {"data.txt": "rows", "sub/weights.bin": "w" * 1000}), kind="dataset",
                          schema="sft", producer=PRODUCER.model_copy(update={"stage": "x"}), parents=[])
    assert again.producer.stage == "t"  # content-addressed: the first copy is kept

    # a local copy damaged after download is fetched again
    (got.path / "data.txt").write_text("tampered")
    assert (other.get(m.fingerprint).path / "data.txt").read_text() == "rows"
    # a file deleted in the store: verify (a listing, not a re-hash) says so, and get refuses
    store.fs.rm_file(f"{store.artifact_path(m.fingerprint)}/sub/weights.bin")
    with pytest.raises(ArtifactError, match="file sub/weights.bin is missing"):
        other.verify(m.fingerprint)
    with pytest.raises(ArtifactError):
        other.get(m.fingerprint)


def test_a_half_uploaded_artifact_is_absent_and_replaced(uri, tmp_path):
    store = ArtifactStore(uri, home=tmp_path / "home")
    staged = _stage(store, {"a.txt": "x", "b.txt": "y"})
    from flows.store.artifacts import fingerprint_of

    fp = fingerprint_of(hash_files(staged))
    store.fs.pipe_file(f"{store.artifact_path(fp)}/a.txt", b"x")  # killed before b.txt and the manifest
    assert store.list() == [] and store.unreadable() == [fp]
    assert not store.is_valid(fp)
    with pytest.raises(ArtifactError, match="not in store"):
        store.get(fp)
    assert [name for name, why in store.verify_all() if why] == [fp]
    m = store.publish(staged, kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    assert m.fingerprint == fp and store.is_valid(fp) and store.unreadable() == []


def test_cache_record_lookup(uri, tmp_path):
    store = ArtifactStore(uri, home=tmp_path / "home")
    m = store.publish(_stage(store, {"f": "1"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    rec = CacheRecord(key="k1", node="n", stage="t", outputs={"out": m.fingerprint}, mlflow_run_id=None,
                      duration_s=1.0, metrics={"acc": 1.0})
    assert store.lookup("k1") is None
    store.record(rec)
    other = _other_machine(uri, tmp_path, "home-b")
    assert other.lookup("k1") == rec and other.lookup("missing") is None
    store.fs.pipe_file(store._cache_path("torn"), b'{"key": ')  # a foreign or damaged record: a miss
    assert other.lookup("torn") is None
    store.fs.rm_file(f"{store.artifact_path(m.fingerprint)}/{MANIFEST_FILE}")
    assert other.lookup("k1") is None  # its output is gone: the stage must run again


def test_lease_on_s3_is_exclusive_and_taken_over(uri, tmp_path):
    store = ArtifactStore(uri, home=tmp_path / "home")
    first = L.Lease(store, "key1", ttl_s=0.6, renew_every_s=0.15, poll_s=0.05, skew_s=0)
    assert first.files.exclusive  # put_object with If-None-Match: * (moto honours it, as AWS S3 does)
    first.acquire()
    try:
        raw = json.loads(store.fs.cat_file(first.path))
        assert raw["holder"] == first.holder
        # the conditional PUT itself: a second create of the same key is refused by the server
        assert first.files.create("key1.json", b"{}") is False
        with pytest.raises(L.LeaseTimeout):  # renewed past its ttl: not taken over
            L.Lease(store, "key1", ttl_s=5, renew_every_s=1, poll_s=0.05, skew_s=0, timeout_s=1.0).acquire()
        first._stop.set()  # cut off: no more renewals
        first._thread.join()
        with L.hold(store, "key1", ttl_s=5, renew_every_s=1, poll_s=0.05, skew_s=0, timeout_s=10) as second:
            assert second.took_over == first.holder
            first.release()  # taken over: the new holder's object stays
            assert json.loads(store.fs.cat_file(first.path))["holder"] == second.holder
    finally:
        first.release()
    assert not store.fs.exists(first.path)
    assert store.fs.find(f"{store.base}/leases") == []  # no lease, takeover token or temporary object left


_S3_WORKER = textwrap.dedent("""
    import json, sys, time
    from flows.store.lease import hold
    from flows.store.artifacts import ArtifactStore
    uri, home, log = sys.argv[1:4]
    store = ArtifactStore(uri, home=home)
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(2):
        with hold(store, "contended", ttl_s=5, renew_every_s=1, poll_s=0.02, skew_s=0):
            start = time.time()
            time.sleep(0.15)
            end = time.time()
        with open(log, "a") as f:
            f.write(json.dumps([start, end]) + "\\n")
""")


def test_two_processes_share_one_s3_lease(uri, s3_env, tmp_path):
    import os

    from tests.test_lease import assert_taking_turns

    ArtifactStore(uri, home=tmp_path / "home")  # makes the bucket
    log = tmp_path / "intervals.jsonl"
    env = {**os.environ, **s3_env}
    procs = [subprocess.Popen([sys.executable, "-c", _S3_WORKER, uri, str(tmp_path / f"h{i}"), str(log)], cwd=REPO,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(2)]
    t0 = time.time()
    intervals = assert_taking_turns(procs, log, 4)
    assert intervals[0][0] >= t0
