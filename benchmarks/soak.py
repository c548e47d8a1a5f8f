"""Soak: concurrent pipelines on one fresh home, killed at random; nothing may be lost, corrupted or left running.

    .venv/bin/python benchmarks/soak.py                     # 20 runs, 10 kills, 3 at a time, r1 / tiny
    .venv/bin/python benchmarks/soak.py --runs 30 --kills 15 --concurrency 4 --report soak.json

1. Reference: each variant (a set of `--set` overrides) runs once, alone and unharmed, in a home of
   its own; its per-node output fingerprints are the reference.
2. Soak: `--runs` runs on one fresh home, `--concurrency` at a time: half of the reference variants
   (cached after their first run), half new variants (`grpo_final.learning_rate` drawn at random:
   grpo_final and the six nodes after it compute for real). Runs are signalled after a random delay
   until `--kills` signals have landed on live runs, alternately SIGKILL and SIGTERM, sent to the
   CLI's pid alone (as `kill PID` and `timeout` do). A killed run is queued again once, as a user
   would re-run it: it resumes from the stage's checkpoint. A run that was not killed must succeed.
3. Final: every variant once more, unharmed, on the soaked home: each must succeed, and every node's
   outputs must have the reference fingerprints (or, where the soak resumed a stage from a checkpoint,
   the report says so: resumed training follows the same curve to float rounding, not bit for bit).
4. Checks: `r1flow artifacts --verify` on the soaked home (every artifact's files against their hashes);
   no process left from any run (processes carry R1FLOW_RUN_PROCESS=<the CLI's pid>:...); the sqlite
   databases pass `PRAGMA integrity_check`; litter (staging, incoming, launch work folders) counted.

Prints a report and writes it as JSON. Not part of CI (tens of minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.runtime import lifetime  # noqa: E402

R1FLOW = [sys.executable, "-m", "flows.cli"]
REFERENCE = {
    "default": [],
    "dpo_beta": ["dpo.beta=0.2"],
    "grpo_final_lr": ["grpo_final.learning_rate=5e-4"],
}
VARIANTS = dict(REFERENCE)  # plus the soak's new variants


@dataclass
class RunRecord:
    index: int
    variant: str
    pid: int = 0
    signal: str | None = None
    delay_s: float | None = None
    returncode: int | None = None
    seconds: float = 0.0
    leftover: list[int] = field(default_factory=list)
    error_tail: str = ""


def soak_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, R1FLOW_HOME=str(home), PYTHONPATH=str(ROOT))
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", lifetime.TOKEN_VAR, lifetime.PARENT_VAR):
        env.pop(key, None)
    return env


def run_command(recipe: str, profile: str, variant: str, out: Path | None = None) -> list[str]:
    cmd = [*R1FLOW, "run", "--recipe", recipe, "--profile", profile]
    for s in VARIANTS[variant]:
        cmd += ["--set", s]
    return cmd + (["--json", str(out)] if out else [])


def fingerprints(result_json: Path) -> dict[str, dict[str, str]]:
    result = json.loads(result_json.read_text())
    return {s["node"]: s["outputs"] for s in result["stages"]}


def reference(args, work: Path) -> dict[str, dict[str, dict[str, str]]]:
    refs = {}
    for variant in REFERENCE:
        home = work / f"ref-{variant}"
        out = work / f"ref-{variant}.json"
        t0 = time.monotonic()
        done = subprocess.run(run_command(args.recipe, args.profile, variant, out), cwd=work, env=soak_env(home),
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"reference run {variant} failed:\n{done.stderr[-3000:]}")
        refs[variant] = fingerprints(out)
        print(f"reference {variant}: {len(refs[variant])} nodes in {time.monotonic() - t0:.0f} s", flush=True)
    return refs


def soak(args, work: Path, home: Path) -> list[RunRecord]:
    rng = random.Random(args.seed)
    signals = [signal.SIGKILL, signal.SIGTERM]
    records, running, queue, requeued = [], [], [], set()
    kills_landed = 0
    while len(records) < args.runs or running:
        while len(records) < args.runs and len(running) < args.concurrency:
            if queue:
                variant = queue.pop(0)
            elif rng.random() < 0.5:
                variant = rng.choice(list(REFERENCE))
            else:
                variant = f"grpo_final_lr_{rng.uniform(1e-4, 3e-3):.2e}"
                VARIANTS[variant] = [f"grpo_final.learning_rate={variant.rsplit('_', 1)[1]}"]
            rec = RunRecord(len(records), variant)
            pending = kills_landed + sum(1 for r, *_ in running if r.signal)
            if pending < args.kills:
                rec.signal = signals[(kills_landed + len(running)) % 2].name
                rec.delay_s = round(rng.uniform(3.0, args.max_delay), 1)
            log = open(work / f"run-{rec.index}.log", "w")
            proc = subprocess.Popen(run_command(args.recipe, args.profile, rec.variant), cwd=work, env=soak_env(home),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            rec.pid = proc.pid
            running.append((rec, proc, time.monotonic(), log))
            records.append(rec)
        time.sleep(0.2)
        for item in list(running):
            rec, proc, t0, log = item
            if rec.signal and rec.returncode is None and proc.poll() is None and time.monotonic() - t0 >= rec.delay_s:
                proc.send_signal(signal.Signals[rec.signal])
                rec.returncode = -1  # marks "signal sent"; the real code is read below
            if proc.poll() is not None:
                rec.returncode, rec.seconds = proc.returncode, round(time.monotonic() - t0, 1)
                log.close()
                time.sleep(lifetime.SENTINEL_GRACE_S + 2)  # the sentinel's SIGTERM, grace, SIGKILL
                rec.leftover = lifetime.processes_started_by(rec.pid)
                if rec.signal and rec.returncode == 0:
                    rec.signal += " (after it finished)"
                elif rec.signal:
                    kills_landed += 1
                    if rec.variant not in requeued:
                        queue.append(rec.variant)
                        requeued.add(rec.variant)
                if rec.returncode != 0 and not rec.signal:
                    rec.error_tail = (work / f"run-{rec.index}.log").read_text(errors="replace")[-2000:]
                running.remove(item)
                print(f"run {rec.index:2d} {rec.variant:28s} {rec.signal or 'unharmed':28s} exit {rec.returncode:4d} "
                      f"in {rec.seconds:6.1f} s; leftover processes: {len(rec.leftover)}", flush=True)
    return records


def integrity(home: Path) -> dict[str, str]:
    out = {}
    for db in sorted(home.rglob("*.db")):
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
                out[str(db.relative_to(home))] = con.execute("PRAGMA integrity_check").fetchone()[0]
        except sqlite3.Error as e:
            out[str(db.relative_to(home))] = f"error: {e}"
    return out


def litter(home: Path) -> dict[str, int]:
    tmp = Path(tempfile.gettempdir())
    return {
        "staging (home/tmp)": sum(1 for _ in (home / "tmp").iterdir()) if (home / "tmp").exists() else 0,
        "incoming (artifacts/.incoming-*)": len(list(home.glob("artifacts/.incoming-*"))),
        "corrupt copies (artifacts/.corrupt-*)": len(list(home.glob("artifacts/.corrupt-*"))),
        "launch work folders (r1flow-launch-*)": len(list(tmp.glob("r1flow-launch-*"))),
        "checkpoint folders": len([p for p in (home / "checkpoints").glob("*") if p.is_dir()])
        if (home / "checkpoints").exists() else 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="r1")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=40.0, help="signals land 3 s to this many seconds into a run")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a new temp folder)")
    ap.add_argument("--report", type=Path, default=Path("soak.json"))
    args = ap.parse_args()
    if args.kills > args.runs:
        ap.error("--kills must not exceed --runs")
    work = (args.work or Path(tempfile.mkdtemp(prefix="r1flow-soak-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    print(f"soak in {work}: {args.runs} runs, {args.kills} kills, {args.concurrency} at a time, "
          f"{args.recipe}/{args.profile}; reference variants {', '.join(REFERENCE)}", flush=True)

    t0 = time.monotonic()
    refs = reference(args, work)
    records = soak(args, work, home)

    final, mismatched = {}, {}
    for variant in REFERENCE:
        out = work / f"final-{variant}.json"
        done = subprocess.run(run_command(args.recipe, args.profile, variant, out), cwd=work, env=soak_env(home),
                              capture_output=True, text=True)
        final[variant] = done.returncode
        if done.returncode == 0:
            got = fingerprints(out)
            mismatched[variant] = sorted(n for n, outs in refs[variant].items() if got.get(n) != outs)
        else:
            mismatched[variant] = [f"run failed: {done.stderr[-1500:]}"]
        print(f"final {variant}: exit {done.returncode}; nodes differing from the reference: "
              f"{mismatched[variant] or 'none'}", flush=True)

    verify = subprocess.run([*R1FLOW, "artifacts", "--verify"], cwd=work, env=soak_env(home), capture_output=True,
                            text=True)
    orphans = sorted({p for r in records for p in lifetime.processes_started_by(r.pid)})
    report = {
        "runs": len(records),
        "kills": sum(1 for r in records if r.signal and "after" not in r.signal),
        "killed_then_rerun": sum(1 for r in records if r.signal and "after" not in r.signal
                                 and any(o.index > r.index and o.variant == r.variant for o in records)),
        "sigkill": sum(1 for r in records if r.signal == "SIGKILL"),
        "sigterm": sum(1 for r in records if r.signal == "SIGTERM"),
        "unharmed_failures": [asdict(r) for r in records if not r.signal and r.returncode != 0],
        "sigterm_exit_codes": sorted({r.returncode for r in records if r.signal == "SIGTERM"}),
        "leftover_processes_after_a_run": sum(len(r.leftover) for r in records),
        "orphans_at_end": orphans,
        "final_runs_exit": final,
        "nodes_differing_from_reference": mismatched,
        "artifacts_verify_exit": verify.returncode,
        "artifacts_verify_tail": verify.stdout.splitlines()[-3:] + verify.stderr.splitlines()[-3:],
        "databases": integrity(home),
        "litter": litter(home),
        "minutes": round((time.monotonic() - t0) / 60, 1),
        "records": [asdict(r) for r in records],
        "work": str(work),
    }
    args.report.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "records"}, indent=2))
    ok = (not report["unharmed_failures"] and not orphans and not report["leftover_processes_after_a_run"]
          and all(c == 0 for c in final.values()) and verify.returncode == 0
          and all(v == "ok" for v in report["databases"].values()))
    print("soak:", "PASSED" if ok else "FAILED", f"(report: {args.report})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
