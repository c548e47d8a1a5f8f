"""Kill -9 the CLI in the middle of SFT, run the same command again: it resumes from the last
checkpoint and trains exactly the remaining steps (the in-process test in test_sft.py checks the
loss against an uninterrupted run at every crash position)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS, EVERY = 400, 40
ARGS = ["-m", "flows.cli", "run", "--recipe", "sft-eval", "--profile", "tiny",
        "--set", f"sft.max_steps={MAX_STEPS}", "--set", f"sft.checkpoint_every={EVERY}"]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, R1FLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"), PYTHONPATH=str(ROOT))
    env.pop("PREFECT_API_URL", None)
    return env


def _checkpoints(home: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in home.glob("checkpoints/*/step-*/state.json"))


def test_sigkill_during_sft_then_rerun_resumes(tmp_path):
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, *ARGS], cwd=tmp_path, env=_env(home), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while not _checkpoints(home) or max(_checkpoints(home)) < 2 * EVERY:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint appeared in time"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = max(_checkpoints(home))
    assert killed_at < MAX_STEPS
    assert not list(home.glob("cache/*.json")) or all(
        json.loads(p.read_text())["node"] != "sft" for p in home.glob("cache/*.json"))  # sft never published

    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, *ARGS, "--json", str(out)], cwd=tmp_path, env=_env(home),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sft = next(s for s in json.loads(out.read_text())["stages"] if s["node"] == "sft")
    resumed = int(sft["metrics"]["resumed_from_step"])
    assert resumed >= killed_at and resumed % EVERY == 0  # the last complete checkpoint (maybe one more landed)
    assert sft["status"] == "run"
    assert int(sft["metrics"]["trained_steps"]) == MAX_STEPS - resumed
    assert not any(home.glob("checkpoints/*"))  # spent checkpoints are removed once the model is published
