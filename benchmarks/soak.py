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

With `--server-kills N` (issue 44) the soak runs against `r1flow up` servers of the soaked home (the CLI finds
them, nothing exported) and kills one N times, Prefect and MLflow in turn, by process group with SIGKILL while
runs are live: each live run must end with the one line naming the server within 30 s (they are queued again),
then `r1flow up --detach` must recover the home, and the soak goes on. The checks add: no Prefect flow run and no
MLflow run left RUNNING, and both servers' databases (`servers/prefect.db`, `servers/mlflow.db`) intact.

    .venv/bin/python benchmarks/soak.py --runs 24 --kills 12 --server-kills 2   # issue 44's acceptance

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

from flows.servers import servers  # noqa: E402
from stages.runtime import lifetime  # noqa: E402

R1FLOW = [sys.executable, "-m", "flows.cli"]
REFERENCE = {
    "default": [],
    "dpo_beta": ["dpo.beta=0.2"],
    "grpo_final_lr": ["grpo_final.learning_rate=5e-4"],
}
VARIANTS = dict(REFERENCE)  # plus the soak's new variants
LOST_LINE = "stopped responding"  # flows/run/watchdog.py's line for a server that went away
LOST_WITHIN_S = 30.0


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
    server_lost: str | None = None  # the server killed while it ran, when its run ended saying so
    ended_after_kill_s: float | None = None


@dataclass
class ServerKill:
    server: str
    at_run: int
    live_runs: int
    runs_ended_s: list[float] = field(default_factory=list)  # each live run: kill to exit
    runs_saying_so: int = 0  # of those, how many printed the one line naming the server
    runs_succeeded: int = 0  # ...and how many finished before it mattered (exit 0)
    up_exit: int | None = None
    up_s: float | None = None
    up_tail: str = ""


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


def kill_server(args, work: Path, home: Path, running: list, records: list, kills: list[ServerKill]) -> None:
    """SIGKILL a server's process group while runs are live; wait for each live run to end, then `r1flow up`."""
    info = servers.status(home)
    name = ("prefect", "mlflow")[len(kills) % 2]
    server = getattr(info, name)
    kill = ServerKill(name, len(records), len(running))
    t0 = time.monotonic()
    os.killpg(server.pgid, signal.SIGKILL)
    print(f"server kill {len(kills) + 1}: {name} (pid {server.pid}, {server.url}) with {len(running)} runs live",
          flush=True)
    for rec, proc, _, log in list(running):
        if rec.signal and rec.returncode is None:  # its signal was not sent yet, and will not be
            rec.signal, rec.delay_s = None, None
        try:
            proc.wait(timeout=LOST_WITHIN_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ended = round(time.monotonic() - t0, 1)
        kill.runs_ended_s.append(ended)
        log.flush()
        if LOST_LINE in (work / f"run-{rec.index}.log").read_text(errors="replace"):
            kill.runs_saying_so += 1
            rec.server_lost, rec.ended_after_kill_s = name, ended
        elif proc.returncode == 0:
            kill.runs_succeeded += 1
    t1 = time.monotonic()
    up = subprocess.run([*R1FLOW, "up", "--detach"], cwd=work, env=soak_env(home), capture_output=True, text=True)
    kill.up_exit, kill.up_s = up.returncode, round(time.monotonic() - t1, 1)
    kill.up_tail = (up.stdout + up.stderr)[-1500:]
    print(f"  live runs ended in {kill.runs_ended_s} s, {kill.runs_saying_so} saying so; r1flow up: exit "
          f"{up.returncode} in {kill.up_s} s", flush=True)
    kills.append(kill)


def soak(args, work: Path, home: Path, server_kills: list[ServerKill] | None = None) -> list[RunRecord]:
    rng = random.Random(args.seed)
    signals = [signal.SIGKILL, signal.SIGTERM]
    records, running, queue, requeued = [], [], [], set()
    kills_landed = 0
    # server kills at evenly spaced run indices, once a run has been live a while
    kill_at = [round((i + 1) * args.runs / (args.server_kills + 1)) for i in range(args.server_kills)]
    while len(records) < args.runs or running:
        if (server_kills is not None and kill_at and len(records) >= kill_at[0]
                and any(time.monotonic() - t0 > 10 for _, _, t0, _ in running)):
            kill_at.pop(0)
            kill_server(args, work, home, running, records, server_kills)
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
                if rec.server_lost:  # its server was killed: run it again, as a user would after `r1flow up`
                    queue.append(rec.variant)
                elif rec.signal and rec.returncode == 0:
                    rec.signal += " (after it finished)"
                elif rec.signal:
                    kills_landed += 1
                    if rec.variant not in requeued:
                        queue.append(rec.variant)
                        requeued.add(rec.variant)
                if rec.returncode != 0 and not rec.signal and not rec.server_lost:
                    rec.error_tail = (work / f"run-{rec.index}.log").read_text(errors="replace")[-2000:]
                running.remove(item)
                print(f"run {rec.index:2d} {rec.variant:28s} {rec.signal or rec.server_lost and rec.server_lost + ' lost' or 'unharmed':28s} exit {rec.returncode:4d} "
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


def running_records(home: Path) -> dict[str, list[str]]:
    """Prefect flow runs and MLflow runs still RUNNING (or PENDING) on the home's `r1flow up` servers."""
    info = servers.status(home)
    if info is None:
        return {"error": ["no servers running for the home"]}
    os.environ.update(servers.env_for(info))
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters as f
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(flow_run_filter=f.FlowRunFilter(state=f.FlowRunFilterState(
            type=f.FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))))
    mlflow = MlflowClient(info.mlflow_tracking_uri)
    exps = [e.experiment_id for e in mlflow.search_experiments()]
    runs = mlflow.search_runs(exps, "attributes.status = 'RUNNING'") if exps else []
    return {"prefect_flow_runs": [str(r.id) for r in flows], "mlflow_runs": [r.info.run_id for r in runs]}


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
    ap.add_argument("--server-kills", type=int, default=0, help="run against `r1flow up` servers and kill one this "
                    "many times (Prefect and MLflow in turn), each followed by `r1flow up --detach`")
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
    server_kills: list[ServerKill] | None = None
    if args.server_kills:
        servers.start(home)
        server_kills = []
    try:
        return finish(args, work, home, refs, soak(args, work, home, server_kills), server_kills, t0)
    finally:
        if server_kills is not None:
            servers.stop(home)


def finish(args, work: Path, home: Path, refs, records: list[RunRecord], server_kills: list[ServerKill] | None,
           t0: float) -> int:

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
    still_running = running_records(home) if server_kills is not None else {}
    report = {
        "runs": len(records),
        "kills": sum(1 for r in records if r.signal and "after" not in r.signal),
        "killed_then_rerun": sum(1 for r in records if r.signal and "after" not in r.signal
                                 and any(o.index > r.index and o.variant == r.variant for o in records)),
        "sigkill": sum(1 for r in records if r.signal == "SIGKILL"),
        "sigterm": sum(1 for r in records if r.signal == "SIGTERM"),
        "unharmed_failures": [asdict(r) for r in records if not r.signal and not r.server_lost and r.returncode != 0],
        "sigterm_exit_codes": sorted({r.returncode for r in records if r.signal == "SIGTERM"}),
        "leftover_processes_after_a_run": sum(len(r.leftover) for r in records),
        "orphans_at_end": orphans,
        "final_runs_exit": final,
        "nodes_differing_from_reference": mismatched,
        "artifacts_verify_exit": verify.returncode,
        "artifacts_verify_tail": verify.stdout.splitlines()[-3:] + verify.stderr.splitlines()[-3:],
        "server_kills": [asdict(k) for k in server_kills or []],
        "runs_lost_to_a_server": sum(1 for r in records if r.server_lost),
        "running_records_at_end": still_running,
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
          and all(v == "ok" for v in report["databases"].values())
          and not any(still_running.values())
          and all(k.up_exit == 0 and k.runs_saying_so + k.runs_succeeded == k.live_runs
                  and max(k.runs_ended_s, default=0) < LOST_WITHIN_S
                  for k in server_kills or []))
    print("soak:", "PASSED" if ok else "FAILED", f"(report: {args.report})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
