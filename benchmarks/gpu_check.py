"""The one-shot GPU check, the parts in order of importance, each in its own process with its own time limit.

    bash benchmarks/gpu_check.sh --device cuda          # on a lent GPU machine (installs the carried wheels first)
    bash benchmarks/gpu_check.sh --device cpu --quick   # the CPU smoke run of the same parts (tests/test_gpu_check.py)

Parts: `env` (versions, nvidia-smi, which packages import), `tests` (tests/test_cuda.py), `grpo`
(benchmarks/suite.py GRPO, r1flow then TRL, on the random-weight SmolLM2 on CUDA: 16 prompts x 8 x 128
tokens), `generation` (benchmarks/generation.py --compare: generate() dynamic and static cache against
r1flow's decode, bf16 weights), `sft_dpo` (the suite's SFT and DPO, quick), `generation_fp32` (the same
compare with fp32 weights, as the stages hold them), `learning` (benchmarks/learning.py, when it exists), and
with `--phases` after `grpo`: `phases` (benchmarks/grpo_phases.py: the GRPO step split into rollout, batch,
reference, forward, backward, loss, optimizer, each between device synchronisations, with the dynamic cache and
with CUDA graphs).
A part that fails or runs out of time is recorded with its reason and the next one runs; the whole
check stops starting parts at `--budget` seconds. Under `--out` (the device's $OUT): `gpu_check.log`
(every part's output), `summary.json` and `summary.md` (rewritten after every part, so a check cut
short still leaves the numbers so far) and `suite.json` (the suite's raw measurements).
The interpreter is this one (`PYTHON` in gpu_check.sh); TRL's side runs only where trl and datasets import.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GEN_MARK = "GEN-RESULT "

# seconds each part may take at most (cuda, cpu --quick); the check's own --budget caps them all
LIMITS = {"env": (60, 120), "tests": (90, 180), "grpo/r1flow": (150, 300), "grpo/trl": (180, 300),
          "generation": (150, 180), "sft_dpo/r1flow": (100, 300), "sft_dpo/trl": (100, 300),
          "generation_fp32": (90, 120), "learning": (150, 300), "phases": (180, 300)}
# in the order they run, after env; `phases` only with --phases
PARTS = ("tests", "grpo", "phases", "generation", "sft_dpo", "generation_fp32", "learning")
MIN_START_S = 20  # a part is not started with less time than this left

ENV_PROBE = r"""
import importlib, json, platform, sys
out = {"python": sys.version.split()[0], "platform": platform.platform(), "modules": {}}
for name in ["torch", "transformers", "tokenizers", "accelerate", "peft", "huggingface_hub", "safetensors", "numpy",
             "pyarrow", "pandas", "fsspec", "typing_extensions", "pydantic", "datasets", "trl", "gguf", "reasoning_gym",
             "math_verify", "schemas.configs", "stages.grpo", "stages.sft", "stages.preference_optimization",
             "stages.prompts", "stages.rewards.verifiers"]:
    try:
        m = importlib.import_module(name)
        out["modules"][name] = getattr(m, "__version__", "ok")
    except Exception as err:
        out["modules"][name] = "ERROR " + type(err).__name__ + ": " + str(err)[:300]
import torch
out["cuda"] = torch.cuda.is_available()
if out["cuda"]:
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sm_count": p.multi_processor_count,
                  "capability": list(torch.cuda.get_device_capability(0)), "bf16": torch.cuda.is_bf16_supported(),
                  "cuda_runtime": torch.version.cuda}
out["threads"] = torch.get_num_threads()
print("ENV-RESULT " + json.dumps(out))
"""


class Check:
    def __init__(self, out: Path, device: str, quick: bool, budget: float, model: str):
        self.out, self.device, self.quick, self.model = out, device, quick, model
        self.cuda = device.startswith("cuda")
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.work = Path(tempfile.mkdtemp(prefix="r1flow-gpu-check-"))
        self.log = (out / "gpu_check.log").open("a")
        self.summary: dict = {"device": device, "quick": quick, "model": model, "budget_s": budget,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
        self.suite_raw: dict = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "HF_HOME": str(self.work / "hf"), "R1FLOW_HOME": str(self.work / "home")}

    # ------------------------------------------------------------------------ plumbing

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, part: str, cmd: list[str]) -> dict:
        """Run `cmd` with the part's limit (or what is left of the budget); its output goes to the log as it
        comes. Returns status (ok, failed, timeout, skipped), rc, seconds, output."""
        limit = min(LIMITS[part][0 if self.cuda else 1], self.left())
        if limit < MIN_START_S:
            self.say(f"\n=== {part}: not started, {self.left():.0f} s of the budget left")
            return {"status": "skipped", "reason": f"no time left ({self.left():.0f} s of the budget)", "output": ""}
        shown = " ".join("<ENV_PROBE>" if c == ENV_PROBE else c for c in cmd)
        self.say(f"\n=== {part} (limit {limit:.0f} s): {shown}")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        lines: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                lines.append(line)
                self.log.write(line)
                self.log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc, status = None, "timeout"
        reader.join(timeout=10)
        secs = time.monotonic() - t0
        self.say(f"=== {part}: {status} (exit {rc}) in {secs:.1f} s")
        out = "".join(lines)
        res = {"status": status, "rc": rc, "seconds": round(secs, 1), "output": out}
        if status != "ok":
            res["reason"] = (f"timed out after {limit:.0f} s" if status == "timeout" else f"exit {rc}") + \
                ": " + " | ".join(ln.strip() for ln in out.strip().splitlines()[-3:])[-600:]
        return res

    def record(self, part: str, res: dict, numbers: dict | None = None) -> None:
        entry = {k: v for k, v in res.items() if k != "output"}
        if numbers is not None:
            entry["numbers"] = numbers
        self.summary["parts"][part] = entry
        self.summary["elapsed_s"] = round(time.monotonic() - self.start, 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        (self.out / "summary.md").write_text(markdown(self.summary))
        if self.suite_raw:
            (self.out / "suite.json").write_text(json.dumps(self.suite_raw, indent=1, default=str))

    # ------------------------------------------------------------------------ parts

    def part_env(self) -> bool:
        """Versions, GPU, importable packages; returns whether TRL's side can run."""
        if shutil.which("nvidia-smi"):
            try:
                smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
            except subprocess.TimeoutExpired:
                smi = "nvidia-smi timed out"
        else:
            smi = "nvidia-smi: not on PATH"
        self.say("\n=== nvidia-smi\n" + smi)
        res = self.run("env", [PY, "-c", ENV_PROBE])
        found = [ln for ln in res["output"].splitlines() if ln.startswith("ENV-RESULT ")]
        numbers = json.loads(found[-1][len("ENV-RESULT "):]) if found else {}
        numbers["nvidia_smi"] = smi.strip().splitlines()[:12]
        if found:
            res.pop("reason", None)
            res["status"] = "ok"
        mods = numbers.get("modules", {})
        broken = {k: v for k, v in mods.items() if str(v).startswith("ERROR")}
        trl_ok = bool(mods) and not any(k in broken for k in ("trl", "datasets"))
        numbers["trl_side"] = "runs" if trl_ok else "not run: " + "; ".join(
            f"{k}: {broken.get(k, 'not probed')}" for k in ("trl", "datasets") if k in broken or not mods)
        if broken:
            numbers["import_errors"] = broken
        self.record("env", res, numbers)
        return trl_ok

    def part_tests(self) -> None:
        res = self.run("tests", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests/test_cuda.py"])
        counts = {}
        for line in res["output"].splitlines()[::-1]:
            if " in " in line and any(w in line for w in ("passed", "failed", "skipped", "error")):
                for chunk in line.strip("= \n").split(" in ")[0].split(","):
                    n, _, what = chunk.strip().partition(" ")
                    if n.isdigit():
                        counts[what] = int(n)
                break
        counts["failures"] = [ln.strip() for ln in res["output"].splitlines() if ln.startswith(("FAILED", "ERROR"))][:20]
        if res["status"] == "failed" and counts.get("failed"):
            res["reason"] = f"{counts['failed']} CUDA test(s) failed"
        self.record("tests", res, counts)

    def suite(self, part: str, tasks: str, framework: str, quick: bool) -> dict | None:
        """One framework's run of the suite; its raw result (also kept for suite.json) or None. GRPO on CUDA decodes
        with r1flow's CUDA graphs (`cache: graph`, r1flow's own decode; TRL keeps its default dynamic cache)."""
        raw = self.work / f"{part.replace('/', '-')}.json"
        cache = ["--cache", "graph"] if self.cuda and not quick and "grpo" in tasks else []
        cmd = [PY, "benchmarks/suite.py", "--device", self.device, "--models", self.model, "--tasks", tasks,
               "--frameworks", framework, "--json", str(raw), "--work-dir", str(self.work / part.replace("/", "-")),
               "--quiet-wait", "0", *cache] + (["--quick"] if quick else [])
        res = self.run(part, cmd)
        data = json.loads(raw.read_text()) if raw.is_file() else None
        if data is not None:
            self.suite_raw[part] = data
        res["suite"] = data is not None
        self.record(part, res)
        return data

    def part_suite(self, name: str, tasks: list[str], trl_ok: bool, trl_reason: str, quick: bool) -> None:
        raw = {"r1flow": self.suite(f"{name}/r1flow", ",".join(tasks), "r1flow", quick)}
        if trl_ok:
            raw["trl"] = self.suite(f"{name}/trl", ",".join(tasks), "trl", quick)
        else:
            self.record(f"{name}/trl", {"status": "skipped", "reason": trl_reason})
        try:
            numbers = suite_numbers(raw, tasks, self.model)
        except Exception as err:  # the raw measurements are in suite.json all the same
            numbers = {"error": f"{type(err).__name__}: {err}"}
        self.record(name, {"status": "ok" if numbers.get("r1flow") else "failed"}, numbers)

    def part_generation(self, part: str, dtype: str) -> None:
        rows, tokens = (128, 128) if self.cuda and not self.quick else (8, 16)
        res = self.run(part, [PY, "benchmarks/generation.py", "--compare", "--models", self.model, "--rows", str(rows),
                              "--max-new-tokens", str(tokens), "--dtype", dtype, "--device", self.device])
        modes = [json.loads(ln[len(GEN_MARK):]) for ln in res["output"].splitlines() if ln.startswith(GEN_MARK)]
        self.record(part, res, {"modes": modes})

    def part_phases(self) -> None:
        """benchmarks/grpo_phases.py: where the GRPO step's time goes, with and without CUDA graphs on CUDA; --quick
        the tiny model's dry run."""
        raw = self.out / "phases.json"
        args = ["--model", self.model, "--steps", "3"] if self.cuda and not self.quick else \
            ["--model", "tiny", "--quick", "--steps", "1"]
        res = self.run("phases", [PY, "benchmarks/grpo_phases.py", "--device", self.device, *args,
                                  "--work", str(self.work / "phases"), "--json", str(raw)])
        numbers = {}
        if raw.is_file():
            numbers = {r["cache"]: {"first": r["first"], "mean": r["mean"]} for r in json.loads(raw.read_text())["results"]}
        self.record("phases", res, numbers)

    def part_learning(self, trl_ok: bool) -> None:
        """benchmarks/learning.py, short: on CUDA half a minute of GRPO a side from the check's model with no cold
        start (the lent machine has no SmolLM2 weights: steps a minute and the CUDA path, not a gain); --quick the
        tiny model's smoke run, r1flow's side alone."""
        script = ROOT / "benchmarks" / "learning.py"
        if not script.is_file():
            self.record("learning", {"status": "skipped", "reason": "benchmarks/learning.py does not exist"})
            return
        if self.cuda and not self.quick:
            args = ["--model", self.model, "--minutes", "0.5", "--seeds", "1", "--cold-steps", "0", "--eval-prompts", "64",
                    "--transfer-prompts", "32", "--curve-prompts", "32", "--curve-points", "1"]
        else:
            args = ["--model", "tiny", "--quick"]
        raw = self.out / "learning.json"
        sides = "trl,r1flow" if trl_ok and self.cuda and not self.quick else "r1flow"
        res = self.run("learning", [PY, str(script), *args, "--device", self.device, "--sides", sides, "--quiet-wait",
                                    "0", "--work-dir", str(self.work / "learning"), "--json", str(raw),
                                    "--plot", str(self.out / "learning.png")])
        numbers = {}
        if raw.is_file():
            data = json.loads(raw.read_text())
            numbers = {side: {"steps": sum(r["steps"] for r in rs), "train_s": sum(r["train_s"] for r in rs),
                              "step_s": sum(r["train_s"] for r in rs) / max(1, sum(r["steps"] for r in rs))}
                       for side, rs in data["runs"].items()}  # every seed's run together
            numbers["table"] = [{"model": r["label"], "steps": r["steps"], "accuracy": r["task"]["accuracy"],
                                 "ci": r["task"]["ci"]} for r in data["summary"]["rows"]]
        self.record("learning", res, numbers)


def suite_numbers(raw: dict, tasks: list[str], model: str) -> dict:
    """Per framework and task the suite's summary (medians of warm steps, peak memory), and r1flow/TRL ratios."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import speed_report

    out: dict = {}
    steps_prompts = {}
    for fw, data in raw.items():
        entry = (data or {}).get("models", data or {}).get(model)  # the suite's json: {"models": {name: ...}} or {name: ...}
        if not entry:
            continue
        results = entry["results"]
        out[fw] = {t: speed_report.summarize_speed(t, results.get(f"{t}/{fw}")) for t in tasks}
        out.setdefault("info", entry.get("info"))
        out.setdefault("shape", entry.get("shapes", entry.get("shape")))
        if data.get("allocator"):
            out.setdefault("allocator", {})[fw] = data["allocator"]
        steps_prompts[fw] = (results.get(f"grpo/{fw}") or {}).get("step_prompts")
    if "grpo" in tasks and all(steps_prompts.get(fw) for fw in ("r1flow", "trl")):
        # separate suite runs per framework: the check that both sides drew the same prompts is made here
        out["grpo_same_prompts"] = steps_prompts["r1flow"] == steps_prompts["trl"]
    ratios = {}
    for t in tasks:
        a, b = (out.get(fw, {}).get(t) for fw in ("r1flow", "trl"))
        ratios[t] = speed_report.speed_ratio(t, a, b)
        if a and b:
            ratios[f"{t}_peak_memory"] = speed_report.ratio(a["peak_delta_mib"], b["peak_delta_mib"], False)
            if t == "grpo":
                ratios["grpo_generation_tokens_per_s"] = speed_report.ratio(a["gen_tokens_per_s"],
                                                                            b["gen_tokens_per_s"], True)
    out["ratios"] = ratios
    return out


def _fmt(v, spec: str = "{:.3g}") -> str:
    return "-" if v is None else spec.format(v) if isinstance(v, int | float) else str(v)


def markdown(summary: dict) -> str:
    """The summary as a short report: each part's status, then its numbers."""
    parts = summary["parts"]
    lines = [f"# GPU check: {summary['device']}{' (quick)' if summary['quick'] else ''}, model {summary['model']}",
             "", f"started {summary['started']}, {summary.get('elapsed_s', 0):.0f} s of a {summary['budget_s']:.0f} s "
             "budget", "", "| part | status | seconds | reason |", "|---|---|---|---|"]
    for name, p in parts.items():
        lines.append(f"| {name} | {p.get('status')} | {_fmt(p.get('seconds'), '{:.1f}')} | {p.get('reason', '')} |")
    env = parts.get("env", {}).get("numbers", {})
    if env:
        mods = env.get("modules", {})
        lines += ["", f"python {env.get('python')}; GPU {env.get('gpu')}; " + ", ".join(
            f"{k} {v}" for k, v in mods.items() if not str(v).startswith("ERROR") and v != "ok"),
            f"TRL side: {env.get('trl_side')}"]
        lines += [f"- import error: {k}: {v}" for k, v in env.get("import_errors", {}).items()]
    tests = parts.get("tests", {}).get("numbers")
    if tests:
        lines += ["", "tests/test_cuda.py: " + ", ".join(f"{v} {k}" for k, v in tests.items() if k != "failures")]
        lines += [f"- {f}" for f in tests.get("failures", [])]
    for name in ("grpo", "sft_dpo"):
        n = parts.get(name, {}).get("numbers")
        if not n:
            continue
        lines += ["", f"## {name}", "", "| metric | r1flow | TRL | ratio |", "|---|---|---|---|"]
        r1, trl, ratios = n.get("r1flow", {}), n.get("trl", {}), n.get("ratios", {})
        for task, s in r1.items():
            t = (trl or {}).get(task) or {}
            s = s or {}
            if task == "grpo":
                for key in ("total", "generation", "scoring", "training", "gen_tokens_per_s", "mean_length",
                            "peak_mib", "peak_delta_mib"):
                    x = ratios.get("grpo") if key == "total" else ratios.get(
                        "grpo_generation_tokens_per_s") if key == "gen_tokens_per_s" else None
                    lines.append(f"| grpo {key} | {_fmt(s.get(key))} | {_fmt(t.get(key))} | {_fmt(x)} |")
            else:
                for key in ("rate", "step_s", "peak_mib", "peak_delta_mib"):
                    x = ratios.get(task) if key == "rate" else ratios.get(f"{task}_peak_memory") \
                        if key == "peak_delta_mib" else None
                    lines.append(f"| {task} {key} | {_fmt(s.get(key))} | {_fmt(t.get(key))} | {_fmt(x)} |")
    for name in ("generation", "generation_fp32"):
        modes = parts.get(name, {}).get("numbers", {}).get("modes")
        if not modes:
            continue
        m0 = modes[0]
        lines += ["", f"## {name}: {m0['rows']} rows x <= {m0['max_new_tokens']} tokens, greedy, {m0['dtype']}", "",
                  "| mode | seconds | tokens/s | warm-up s | rows equal generate() dynamic | peak GPU MiB |",
                  "|---|---|---|---|---|---|"]
        for m in modes:
            lines.append(f"| {m['mode']} | {m['seconds']:.3f} | {m['tokens_per_s']:.0f} | {m['warmup_s']:.1f} | "
                         f"{m['rows_equal_to_generate_dynamic']}/{m['rows']} | {_fmt(m.get('peak_gpu_mib'), '{:.0f}')} |")
    phases = parts.get("phases", {}).get("numbers")
    if phases:
        from benchmarks.grpo_phases import PHASES

        lines += ["", "## phases of a GRPO step (benchmarks/grpo_phases.py), seconds", "",
                  "| cache | step | " + " | ".join(PHASES) + " | step |", "|" + "---|" * (len(PHASES) + 3)]
        for cache, r in phases.items():
            for which in ("first", "mean"):
                lines.append(f"| {cache} | {which} | " + " | ".join(_fmt(r[which].get(p)) for p in PHASES)
                             + f" | {_fmt(r[which].get('step'))} |")
    learning = parts.get("learning", {}).get("numbers")
    if learning:
        lines += ["", "## learning (benchmarks/learning.py)", "", "| side | GRPO steps | training s | s a step |",
                  "|---|---|---|---|"]
        lines += [f"| {side} | {n['steps']} | {n['train_s']:.1f} | {n['step_s']:.2f} |" for side, n in learning.items()
                  if side != "table"]
        lines += [f"- {r['model']}: {', '.join(map(str, r['steps']))} steps, held-out accuracy {r['accuracy']:.3f} "
                  f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" for r in learning.get("table", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small shapes and few steps (the CPU smoke run)")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-"))
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which no part starts (default: 390 on cuda, 900 on cpu)")
    ap.add_argument("--model", default=None, help="benchmark model (default: smollm2-random on cuda, tiny on cpu)")
    ap.add_argument("--phases", action="store_true", help="also split the GRPO step into phases "
                    "(benchmarks/grpo_phases.py), after the grpo part")
    ap.add_argument("--skip", default="", help=f"comma list of parts not to run, e.g. on a second run with little GPU "
                    f"time left (env always runs): {', '.join(PARTS)}")
    args = ap.parse_args()
    skip = {p for p in args.skip.split(",") if p}
    if skip - set(PARTS):
        ap.error(f"unknown part(s) {sorted(skip - set(PARTS))}; parts: {', '.join(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    check = Check(out, args.device, args.quick, args.budget or (390.0 if cuda else 900.0),
                  args.model or ("smollm2-random" if cuda else "tiny"))
    check.say(f"gpu_check: device {args.device}{' quick' if args.quick else ''}, model {check.model}, python {PY}, "
              f"out {out}, budget {check.summary['budget_s']:.0f} s")
    try:
        trl_ok = check.part_env()
        trl_reason = check.summary["parts"]["env"]["numbers"]["trl_side"]
        parts = {"tests": check.part_tests,
                 "grpo": lambda: check.part_suite("grpo", ["grpo"], trl_ok, trl_reason, quick=args.quick),
                 "generation": lambda: check.part_generation("generation", "bf16" if cuda else "fp32"),
                 "sft_dpo": lambda: check.part_suite("sft_dpo", ["sft", "dpo"], trl_ok, trl_reason, quick=True),
                 "generation_fp32": lambda: check.part_generation("generation_fp32", "fp32") if cuda else None,
                 "learning": lambda: check.part_learning(trl_ok),
                 "phases": check.part_phases}
        for name in PARTS:
            if name == "phases" and not args.phases:
                continue
            if name in skip:
                check.record(name, {"status": "skipped", "reason": "--skip"})
            else:
                parts[name]()
    finally:
        check.say(f"\ngpu_check done in {time.monotonic() - check.start:.0f} s; summary {out / 'summary.md'}")
        check.say((out / "summary.md").read_text() if (out / "summary.md").is_file() else "(no summary)")
        shutil.rmtree(check.work, ignore_errors=True)


if __name__ == "__main__":
    main()
