import json
import os
import re

import pytest

from flows.store.artifacts import ArtifactStore, CacheRecord, fingerprint_of, hash_files
from flows.store.cache import cache_key
from schemas.artifacts import MANIFEST_FILE, Producer
from schemas.errors import ArtifactError

PRODUCER = Producer(stage="t", stage_version="1", config_hash="h")


def stage(store: ArtifactStore, files: dict[str, str]):
    d = store.new_staging_dir()
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def test_publish_is_content_addressed_and_idempotent(tmp_path):
    store = ArtifactStore(tmp_path)
    m1 = store.publish(stage(store, {"a.txt": "x", "sub/b.txt": "y"}), kind="dataset", schema="sft",
                       producer=PRODUCER, parents=[])
    assert m1.fingerprint == fingerprint_of(m1.files)
    assert set(m1.files) == {"a.txt", "sub/b.txt"}
    m2 = store.publish(stage(store, {"a.txt": "x", "sub/b.txt": "y"}), kind="dataset", schema="sft",
                       producer=PRODUCER.model_copy(update={"stage": "other"}), parents=[])
    assert m2.fingerprint == m1.fingerprint and m2.producer.stage == "t"  # first copy kept, immutable
    m3 = store.publish(stage(store, {"a.txt": "z"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    assert m3.fingerprint != m1.fingerprint
    assert {m.fingerprint for m in store.list()} == {m1.fingerprint, m3.fingerprint}
    assert not any((tmp_path / "tmp").iterdir())  # staging dirs moved or removed


def test_manifest_is_written_and_verified(tmp_path):
    store = ArtifactStore(tmp_path)
    m = store.publish(stage(store, {"data.parquet": "bytes"}), kind="dataset", schema="prompts", producer=PRODUCER,
                      parents=["abc"], rows=3, metrics={"acc": 0.5})
    on_disk = json.loads((tmp_path / "artifacts" / m.fingerprint / MANIFEST_FILE).read_text())
    assert on_disk["schema"] == "prompts" and on_disk["rows"] == 3 and on_disk["parents"] == ["abc"]
    assert on_disk["producer"]["stage"] == "t" and on_disk["metrics"] == {"acc": 0.5}
    assert store.get(m.fingerprint).path == tmp_path / "artifacts" / m.fingerprint


def test_verify_detects_tampering_and_deletion(tmp_path):
    store = ArtifactStore(tmp_path)
    m = store.publish(stage(store, {"f": "1", "g": "2"}), kind="model", schema="model", producer=PRODUCER, parents=[])
    root = tmp_path / "artifacts" / m.fingerprint
    (root / "f").write_text("tampered")
    with pytest.raises(ArtifactError, match="file f does not match its hash"):
        store.verify(m.fingerprint)
    (root / "g").unlink()
    assert not store.is_valid(m.fingerprint)
    with pytest.raises(ArtifactError, match=f"artifact {m.fingerprint[:12]}"):
        store.get(m.fingerprint)


def test_incomplete_artifact_is_invisible_and_replaced_on_publish(tmp_path):
    store = ArtifactStore(tmp_path)
    files = {"f": "content"}
    fp = fingerprint_of(hash_files(stage(store, files)))
    leftover = tmp_path / "artifacts" / fp  # a crash between copy and manifest on a non-atomic store
    leftover.mkdir()
    (leftover / "f").write_text("half")
    assert store.list() == [] and not store.is_valid(fp)
    m = store.publish(stage(store, files), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    assert m.fingerprint == fp and store.is_valid(fp)
    assert (leftover / "f").read_text() == "content"


def test_cache_records_are_checked_against_outputs(tmp_path):
    store = ArtifactStore(tmp_path)
    m = store.publish(stage(store, {"f": "1"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    rec = CacheRecord(key="k", node="n", stage="t", outputs={"out": m.fingerprint}, mlflow_run_id=None,
                      duration_s=1.0, metrics={})
    store.record(rec)
    assert store.lookup("k") == rec
    assert store.lookup("missing") is None
    os.remove(tmp_path / "artifacts" / m.fingerprint / "f")
    assert store.lookup("k") is None  # an artifact file deleted: the stage must run again


def test_fsspec_memory_store_roundtrip(tmp_path):
    store = ArtifactStore("memory://r1flow-test-store", home=tmp_path / "home")
    m = store.publish(stage(store, {"a": "x", "d/b": "y"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    assert store.is_valid(m.fingerprint)
    local = store.get(m.fingerprint)
    assert (local.path / "d" / "b").read_text() == "y"
    assert local.path.is_relative_to(tmp_path / "home")
    store.fs.rm(f"{store.artifact_path(m.fingerprint)}/a")
    assert not store.is_valid(m.fingerprint)


def test_resolve_prefix(tmp_path):
    store = ArtifactStore(tmp_path)
    m = store.publish(stage(store, {"a": "x"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    assert store.resolve_prefix(m.fingerprint[:8]) == m.fingerprint
    with pytest.raises(ArtifactError, match="no artifact"):
        store.resolve_prefix("zzzz")


def test_cache_key_depends_on_every_part():
    base = dict(stage="sft", version="1", config={"lr": 1e-4, "n": 2}, inputs={"a": "f1"}, seed=0)
    k = cache_key(**base)
    assert k == cache_key(**dict(base, config={"n": 2, "lr": 1e-4}))  # canonical JSON: key order irrelevant
    for change in ({"stage": "dpo"}, {"version": "2"}, {"config": {"lr": 2e-4, "n": 2}}, {"inputs": {"a": "f2"}},
                   {"seed": 1}, {"salt": "file-hash"}):
        assert cache_key(**dict(base, **change)) != k


def test_publish_across_filesystem_boundaries_and_hidden_incoming(tmp_path):
    """The store root need not be under home (R1FLOW_STORE on another disk): publish still lands
    atomically, and half-moved `.incoming-*` directories never show up as artifacts."""
    store = ArtifactStore(tmp_path / "store", home=tmp_path / "home")
    m = store.publish(stage(store, {"a": "x"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    assert store.is_valid(m.fingerprint)
    half = tmp_path / "store" / "artifacts" / ".incoming-dead"
    half.mkdir()
    (half / MANIFEST_FILE).write_text(m.to_json())
    assert [x.fingerprint for x in store.list()] == [m.fingerprint]


def test_undefined_metrics_leave_the_manifest_readable(tmp_path):
    """JSON has no NaN: written as null, a float metric made the manifest (and the artifact) unreadable. An undefined
    metric (an eval with nothing scored) is left out of `metrics` and named in `extra`."""
    store = ArtifactStore(tmp_path)
    m = store.publish(stage(store, {"f": "1"}), kind="dataset", schema="eval", producer=PRODUCER, parents=[],
                      metrics={"accuracy": float("nan"), "tokens_per_s": float("inf"), "format_rate": 0.5})
    again = store.verify(m.fingerprint)  # reads back
    assert again.metrics == {"format_rate": 0.5}
    assert again.extra["non_finite_metrics"] == {"accuracy": "nan", "tokens_per_s": "inf"}
    assert [x.fingerprint for x in store.list()] == [m.fingerprint]


def test_verify_all_and_the_cli_report_every_damaged_artifact(tmp_path, monkeypatch, capsys):
    from flows.cli.app import main

    store = ArtifactStore(tmp_path)
    good = store.publish(stage(store, {"f": "1"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    edited = store.publish(stage(store, {"f": "2"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    gone = store.publish(stage(store, {"f": "3"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    (tmp_path / "artifacts" / edited.fingerprint / "f").write_text("tampered")
    (tmp_path / "artifacts" / gone.fingerprint / MANIFEST_FILE).unlink()
    (tmp_path / "artifacts" / ".incoming-x").mkdir()  # not an artifact
    results = dict(store.verify_all())
    assert set(results) == {good.fingerprint, edited.fingerprint, gone.fingerprint}
    assert results[good.fingerprint] is None
    assert "does not match its hash" in results[edited.fingerprint]
    assert "no manifest.json" in results[gone.fingerprint]
    assert store.unreadable() == [gone.fingerprint]

    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path))
    assert main(["artifacts", "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {edited.fingerprint[:12]}" in out and f"DAMAGED {gone.fingerprint[:12]}" in out
    assert "1 of 3 artifact(s)" in out and f"DAMAGED {good.fingerprint[:12]}" not in out
    assert main(["artifacts"]) == 0
    out = capsys.readouterr().out
    assert "1 more without a readable manifest" in out and gone.fingerprint[:12] in out
    (tmp_path / "artifacts" / edited.fingerprint / "f").write_text("2")
    import shutil

    shutil.rmtree(tmp_path / "artifacts" / gone.fingerprint)
    assert main(["artifacts", "--verify"]) == 0
    assert "2 of 2 artifact(s)" in capsys.readouterr().out


@pytest.mark.parametrize("damage, why", [
    # issue 59 item 14: both passed `r1flow artifacts --verify`
    (lambda d: (d / "sub").mkdir() or (d / "sub" / "extra.bin").write_text("x"), "file sub/extra.bin is not in its manifest"),
    (lambda d: (d / MANIFEST_FILE).write_text((d / MANIFEST_FILE).read_text().replace('"schema": "sft"',
                                                                                      '"schema": "prompts"')),
     "manifest.json was edited after it was published (its fields no longer match its digest)"),
    (lambda d: (d / MANIFEST_FILE).write_text((d / MANIFEST_FILE).read_text().replace('"stage": "t"', '"stage": "x"')),
     "manifest.json was edited after it was published"),
])
def test_artifacts_verify_fails_an_extra_file_and_an_edited_manifest_field_naming_them(tmp_path, monkeypatch, capsys,
                                                                                        damage, why):
    from flows.cli.app import main

    store = ArtifactStore(tmp_path)
    good = store.publish(stage(store, {"f": "1"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    hurt = store.publish(stage(store, {"f": "2"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[],
                         metrics={"loss": 0.1 + 0.2})
    assert store.verify(hurt.fingerprint).digest == hurt.digest is not None  # a manifest read back verifies
    damage(tmp_path / "artifacts" / hurt.fingerprint)
    with pytest.raises(ArtifactError, match=f"^artifact {hurt.fingerprint[:12]}: {re.escape(why)}"):
        store.verify(hurt.fingerprint)
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path))
    assert main(["artifacts", "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {hurt.fingerprint[:12]}: artifact {hurt.fingerprint[:12]}: {why}" in out, out
    assert "1 of 2 artifact(s)" in out and f"DAMAGED {good.fingerprint[:12]}" not in out
    # the cache: a record whose output is damaged is not reused, and says why
    store.record(CacheRecord(key="k" * 64, node="n", stage="s", outputs={"data": hurt.fingerprint},
                             mlflow_run_id="r", duration_s=1.0, metrics={}))
    damaged: list = []
    assert store.lookup("k" * 64, damaged) is None and damaged[0][0] == "data" and why in damaged[0][1]


def test_a_manifest_published_before_digests_still_verifies(tmp_path):
    store = ArtifactStore(tmp_path)
    m = store.publish(stage(store, {"f": "1"}), kind="dataset", schema="sft", producer=PRODUCER, parents=[])
    path = tmp_path / "artifacts" / m.fingerprint / MANIFEST_FILE
    old = json.loads(path.read_text())
    del old["digest"]
    path.write_text(json.dumps(old))
    assert store.verify(m.fingerprint).digest is None


# ---------------------------------------------------------------------------- a full disk (issue 44 item 14)


@pytest.fixture()
def small_fs():
    """mount(path, size): a tmpfs of `size` at `path` (real ENOSPC, no mock), unmounted at teardown. Needs
    root (CI runs as root); skips where a tmpfs cannot be mounted."""
    import subprocess

    mounted = []

    def mount(path, size: str):
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()} (a full filesystem needs root)")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_while_a_stage_saves_its_model_is_one_line_naming_path_and_store(tmp_path, small_fs,
                                                                                      tiny_model_input):
    """The issue: a raw `SafetensorError ... No space left on device` with tracebacks and no path. A stage
    (import_model re-saving a local model as bfloat16: save_pretrained, safetensors) writes its output into
    a staging folder on a filesystem with room for the config but not the weights."""
    from flows.run.pipeline import execute_stage
    from schemas.artifacts import MODEL_DIR

    home = tmp_path / "home"
    staging = small_fs(home / "tmp", "48k")
    settings = {"home": str(home), "store": str(home), "tracking_uri": f"sqlite:///{home}/mlflow.db"}
    with pytest.raises(ArtifactError) as e:
        execute_stage(node="base", stage="import_model", config={"ref": str(tiny_model_input.path / MODEL_DIR),
                                                                 "dtype": "bfloat16"},
                      inputs={}, seed=0, key="d" * 64, parent_run_id=None, settings=settings,
                      experiment="r1flow/disk-full")
    message = str(e.value)
    assert "\n" not in message, message
    assert message.startswith(f"no space left on device writing {staging}/"), message
    assert f"store {home}" in message and "nothing was published" in message, message
    assert e.value.__suppress_context__  # the CLI prints this one line, no chained traceback
    store = ArtifactStore(home, home=home)
    assert os.listdir(staging) == [] and store.list() == [] and store.lookup("d" * 64) is None  # nothing half-written
    assert os.listdir(home / "artifacts") == []


@pytest.mark.slow
def test_a_full_disk_in_r1flow_run_is_one_line_without_prefects_traceback(tmp_path, small_fs):
    """Issue 59 item 11: `r1flow run` on a full disk printed Prefect's ~70-line traceback ("Encountered exception
    during execution") before the promised line (104 lines of stderr). The CLI as a user runs it, its home's staging
    folder on a filesystem without room for the model."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import clean_env

    home = tmp_path / "home"
    staging = small_fs(home / "tmp", "48k")
    env = {**clean_env(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--recipe", "sft-eval", "--profile", "tiny",
                          "--only", "base"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    err = run.stderr
    assert run.returncode == 2, err[-3000:]
    assert "Traceback" not in err and '  File "' not in err, err[-4000:]
    ours = [line for line in err.splitlines() if line.startswith("r1flow: error:")]
    assert len(ours) == 1 and ours[0].startswith(f"r1flow: error: no space left on device writing {staging}/"), err
    assert len(err.splitlines()) < 20, err  # Prefect's progress lines and ours


def test_a_full_store_while_publishing_leaves_no_half_artifact(tmp_path, small_fs):
    home = tmp_path / "home"
    root = small_fs(tmp_path / "store", "256k")
    store = ArtifactStore(root, home=home)  # staging on the home's disk, the artifacts on the full one
    staged = stage(store, {"small.txt": "x", "data/big.bin": "y" * 1_000_000})
    with pytest.raises(ArtifactError) as e:
        store.publish(staged, kind="dataset", schema="prompts", producer=PRODUCER, parents=[])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"no space left on device writing {root}/artifacts/"), message
    assert f"store {root}" in message and "nothing was published" in message, message
    assert os.listdir(root / "artifacts") == [] and store.list() == []  # no .incoming-* left behind
    # a cache record into a store whose disk is full: the same line, and no temporary file left
    with open(root / "filler", "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"z" * 65536)
            f.flush()
    rec = CacheRecord(key="e" * 64, node="n", stage="s", outputs={}, mlflow_run_id="r", duration_s=1.0,
                      metrics={"m": 1.0})
    with pytest.raises(ArtifactError, match=rf"^no space left on device writing {root}/cache/"):
        store.record(rec)
    assert os.listdir(root / "cache") == []


def test_lineage_is_every_text_dataset_among_the_ancestors(tmp_path):
    """flows/store/lineage.py on a small graph: base -> sft model (from sft data and prompts) -> samples (from the
    sft model and prompts) -> dpo model (from sft model and preferences made of the samples); an eval result is not
    training text. The dpo model's lineage: the four text datasets, sorted, each once; the base has none."""
    from flows.store.lineage import ancestor_datasets, with_lineage
    from stages import eval as eval_stage
    from stages import sft as sft_stage

    store = ArtifactStore(tmp_path / "store")

    def put(name: str, kind: str, schema: str, *parents: str) -> str:
        return store.publish(stage(store, {"f": name}), kind=kind, schema=schema, producer=PRODUCER,
                             parents=list(parents)).fingerprint

    base, prompts, data = put("base", "model", "model"), put("p", "dataset", "prompts"), put("d", "dataset", "sft")
    sft = put("sft", "model", "model", base, data, prompts)
    samples = put("s", "dataset", "samples", sft, prompts)
    evals = put("e", "dataset", "eval", sft, prompts)
    prefs = put("q", "dataset", "preferences", samples, evals)
    dpo = put("dpo", "model", "model", sft, prefs)
    assert ancestor_datasets(store, dpo) == sorted([prompts, data, samples, prefs])
    assert ancestor_datasets(store, base) == []
    assert with_lineage(eval_stage, {"model": sft, "prompts": prompts}, store) == {
        "model": sft, "prompts": prompts, **{f"lineage.{fp[:12]}": fp for fp in (data, prompts)}}
    assert with_lineage(sft_stage, {"model": sft, "data": data}, store) == {"model": sft, "data": data}
    # a parent gone from the store: one line naming it and who names it, before any compute
    gone = put("x", "model", "model", "0" * 64)
    with pytest.raises(ArtifactError, match=rf"^the lineage of artifact {gone[:12]}: 000000000000, a parent of "
                       rf"{gone[:12]}, cannot be read \(artifact 000000000000: not in store .*\); its training data "
                       r"cannot be checked$"):
        ancestor_datasets(store, gone)
