"""`learning.py`'s run directories: a new one, the sides a run keeps as it goes (`--resume`), an earlier run's side
reused (`--trl-from`, `--r1flow-from`), and the order the sides of a seed train in."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from benchmarks.learning_plan import Plan

ASYNC_ONLY = ("async_staleness", "async_placement")  # Plan fields read by the r1flow_async side alone


def run_order(sides: list[str], seed_index: int) -> list[str]:
    """Which side trains first for a seed: r1flow for even seed indices, TRL for odd ones, any other side after
    them; a side that always ran first (or last) would carry whatever the machine does over an hour."""
    pair = [s for s in ("r1flow", "trl") if s in sides]
    if seed_index % 2:
        pair.reverse()
    return pair + [s for s in sides if s not in pair]


def new_run_dir(root: Path) -> Path:
    """A run directory of its own, named by the time it started ("-2", "-3", ... after the name when two runs start
    in the same second: one must never write into another's)."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise SystemExit(f"learning.py: no free run directory name under {root} ({name}-N)")


def keep_side(run_dir: Path, seed_index: int, side: str, run: dict) -> None:
    """Keep a trained side's results in the run directory (`seed<k>/<side>.json`), written whole (a temporary file
    renamed), so a stopped run can go on from it (`--resume`)."""
    path = run_dir / f"seed{seed_index}" / f"{side}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(path)


def kept_side(run_dir: Path, seed_index: int, side: str) -> dict | None:
    """A side of a seed that a stopped run finished (`keep_side`), or None: it trains again."""
    path = run_dir / f"seed{seed_index}" / f"{side}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def resumed_run_dir(path: Path, plan: Plan) -> Path:
    """The run directory `--resume` names, if it was made with this very plan but for more `--seeds` (a finished run
    grows by the seeds it lacks): SystemExit naming the first difference (or what is missing) otherwise, before any
    compute."""
    plan_file = path / "plan.json"
    if not plan_file.is_file():
        raise SystemExit(f"--resume {path}: no plan.json there (not a run directory of learning.py)")
    earlier = json.loads(plan_file.read_text())
    if earlier.get("seeds", 1) > plan.seeds:
        raise SystemExit(f"--resume {path}: it ran {earlier['seeds']} seeds, this run asks for {plan.seeds} (--seeds "
                         f"{earlier['seeds']} or more)")
    if difference := plan_difference(earlier, plan, ignore=("seeds",)):
        raise SystemExit(f"--resume {path}: {difference}")
    return path


def settle_equal_steps(run: dict, steps: int) -> None:
    """A run made before the one that sets its equal-steps point saved every step ("step<N>" snapshots): keep step
    `steps` as "equal_steps" and delete the others (a run that stopped short of `steps` has no equal-steps point).
    The saves' seconds, inside that run's clock, are kept in "every_step_save_s"."""
    kept, spent = [], 0.0
    for snap in run["snapshots"]:
        if not snap["name"].startswith("step"):
            kept.append(snap)
            continue
        spent += snap.get("save_s", 0.0)
        if snap["step"] == steps:
            kept.append({**snap, "name": "equal_steps"})
        else:
            shutil.rmtree(snap["adapter"], ignore_errors=True)
    run["snapshots"] = kept
    run["every_step_save_s"] = spent


REUSE_FLAGS = {"trl": "--trl-from", "r1flow": "--r1flow-from"}


def reused_run(path: Path, plan: Plan, side: str) -> dict:
    """An earlier run's raw results (its learning.json, or the run directory holding it), if that run trained `side`
    ("trl" or "r1flow") on the same plan, the other side's own settings (`--r1flow-set` when TRL is reused,
    `--trl-set` when r1flow is) aside, for at least as many seeds: SystemExit naming the first difference otherwise.
    One side's change at a time is then measured against the very same runs of the other side."""
    flag, name = REUSE_FLAGS[side], {"trl": "TRL"}.get(side, side)
    raw_file = path / "learning.json" if path.is_dir() else path
    if not raw_file.is_file():
        raise SystemExit(f"{flag} {path}: no learning.json there")
    raw = json.loads(raw_file.read_text())
    if side not in raw.get("runs", {}):
        raise SystemExit(f"{flag} {path}: that run has no {name} side")
    if not isinstance(raw["runs"][side], list):
        raise SystemExit(f"{flag} {path}: made by the one-seed version of learning.py (before --seeds); run {name} "
                         "again")
    if len(raw["runs"][side]) < plan.seeds:
        raise SystemExit(f"{flag} {path}: it has {len(raw['runs'][side])} {name} seed(s), this run asks for "
                         f"{plan.seeds}")
    other_extra = "r1flow_extra" if side == "trl" else "trl_extra"
    ignore = (other_extra, "seeds", *ASYNC_ONLY)  # settings of the sides not reused
    if difference := plan_difference(raw["plan"], plan, ignore=ignore):
        raise SystemExit(f"{flag} {path}: {difference}")
    return raw


def plan_difference(earlier: dict, plan: Plan, ignore: tuple[str, ...] = ()) -> str | None:
    """The first field (in Plan's order, less `ignore`) in which an earlier run's plan (as its JSON holds it) differs
    from `plan`, said as "its KEY was A, this run's is B"; None when they agree. A field the earlier plan lacks (it
    predates the field) counts as the field's default: a field joins Plan with the default that does what the runs
    before it did (the async side's settings: those runs had no such side)."""
    defaults = json.loads(json.dumps(dataclasses.asdict(Plan())))
    for key, value in json.loads(json.dumps(dataclasses.asdict(plan))).items():
        had = earlier.get(key, defaults[key])
        if key not in ignore and had != value:
            return f"its {key} was {had!r}, this run's is {value!r}"
    return None
