"""`r1flow run --parallel N`: when stages run at once, a failed stage's descendants are skipped, the other
branches finish, and the run then fails naming every error (tests/test_cluster.py checks its fingerprints)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env

pytestmark = pytest.mark.slow

R1FLOW = str(Path(sys.executable).parent / "r1flow")

# Two SFT branches that diverge (--set below: a learning rate no model survives, so the loss turns NaN and the
# stage stops with "training diverged"), one branch that is fine, and a node downstream of a failing one.
RECIPE = """
name: branches
model: tiny-random
nodes:
  base: {stage: import_model, config: {ref: tiny-random}}
  prompts: {stage: prompts}
  sft_a:
    stage: sft
    inputs: {model: base.model, data: prompts.prompts}
  sft_b:
    stage: sft
    inputs: {model: base.model, data: prompts.prompts}
    seed: 1
  eval_base: {stage: eval, inputs: {model: base.model, prompts: prompts.prompts}}
  eval_a: {stage: eval, inputs: {model: sft_a.model, prompts: prompts.prompts}}
"""


def test_a_failed_branch_skips_its_descendants_and_the_others_finish(tmp_path):
    recipe = tmp_path / "branches.yaml"
    recipe.write_text(RECIPE)
    env = clean_env(tmp_path / "home")
    diverge = [f"--set={node}.{key}" for node in ("sft_a", "sft_b") for key in ("learning_rate=1e30", "max_steps=6")]
    r = subprocess.run([R1FLOW, "run", "--recipe", str(recipe), "--profile", "tiny", "--parallel", "2", *diverge], env=env,
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    # every error is named, once, in the run's last words
    last = [line for line in out.splitlines() if "2 stages failed" in line]
    assert last, out[-4000:]
    assert "sft_a: StageError: training diverged" in last[-1] and "sft_b: StageError: training diverged" in last[-1]
    # the branch that does not depend on them finished; the node below a failed one never started
    assert "eval_base (eval) run in" in out, out[-4000:]
    assert "eval_a (eval)" not in out, out[-4000:]
    # each stage process was given its share of the cores by the runner (placement.pool_threads), not its own count
    assert "threads: 1 (R1FLOW_THREADS" in out, out[-4000:]
