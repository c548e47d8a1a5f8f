"""Per-process memory of SFT on N processes: ddp (every process holds the model) against fsdp (each holds 1/N).

    .venv/bin/python benchmarks/fsdp_memory.py --model smollm2 --processes 2 --steps 3

For each distributed_type a fresh child process launches the sft stage through `stages.training.launch`
(`accelerate launch`, gloo on CPU, NCCL on GPUs), full fine-tuning, and reports:
- peak RSS of the largest process it waited for (a rank: `getrusage(RUSAGE_CHILDREN)`), in MiB. On
  CPU this is where the model, gradients and Adam moments live; on GPU the ranks' CPU memory only;
- the parameter elements each process holds (logged by the stage under fsdp; the whole model under ddp);
- the mean step time (steps 2..N: step 1 warms up).
Same model, data, global batch and seed on both sides; nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def fsdp_child(args: argparse.Namespace) -> None:
    from benchmarks.common import stage_input
    from benchmarks.r1flow_side import TimedContext
    from schemas.configs import LoraSpec, ResourcesSpec, SFTConfig
    from stages import sft
    from stages.base import Output
    from stages.training import launch

    prep = json.loads(Path(args.prep).read_text())
    inputs = {k: stage_input(Output(o["kind"], o["schema"], Path(o["path"]), rows=o["rows"])) for k, o in prep.items()}
    cfg = SFTConfig(max_steps=args.steps, batch_size=args.batch, learning_rate=1e-5, lr_scheduler="constant",
                    warmup_ratio=0.0, max_length=256, lora=LoraSpec(r=0), checkpoint_every=10_000,
                    resources=ResourcesSpec(num_processes=args.processes, distributed_type=args.child))
    ctx = TimedContext(Path(args.work) / args.child, device=args.device)
    t0 = time.perf_counter()
    out = launch.run_stage(sft, cfg, {"model": inputs["model"], "data": inputs["sft"]}, ctx)["model"]
    steps = ctx.intervals(2, args.steps) if args.steps > 1 else []
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    print(json.dumps({
        "distributed_type": args.child, "peak_rss_mib": peak_kib / 1024,
        "parameters_per_process": ctx.params.get("parameters_per_process", ctx.params["total_parameters"]),
        "total_parameters": ctx.params["total_parameters"], "final_loss": out.metrics["final_loss"],
        "step_s": sum(steps) / len(steps) if steps else None, "wall_s": time.perf_counter() - t0,
    }))


def prepare_sft_data(model: str, rows: int, work: Path) -> Path:
    from transformers import AutoTokenizer

    from benchmarks.common import CACHE_DIR, MODEL_REFS, sft_rows
    from schemas.artifacts import MODEL_DIR
    from schemas.configs import ModelConfig
    from schemas.datasets import from_rows
    from stages import import_model
    from stages.base import LocalContext, write_dataset

    ctx = LocalContext(work / "prep", cache_dir=CACHE_DIR)
    m = import_model.run(ModelConfig(ref=MODEL_REFS[model]), {}, ctx)["model"]
    tokenizer = AutoTokenizer.from_pretrained(m.path / MODEL_DIR)
    data = write_dataset(ctx, "sft", from_rows(sft_rows(tokenizer, rows, 96, 96), "sft"), "sft")
    prep = {k: {"kind": o.kind, "schema": o.schema, "path": str(o.path), "rows": o.rows}
            for k, o in (("model", m), ("sft", data))}
    path = work / "prep.json"
    path.write_text(json.dumps(prep))
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=["tiny", "smollm2", "1b"])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", default=None)
    p.add_argument("--child", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    p.add_argument("--prep", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return fsdp_child(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="r1flow-fsdp-mem-"))
    prep = prepare_sft_data(args.model, max(16, args.batch * args.steps), work)
    results = {}
    for kind in ("ddp", "fsdp"):  # each in a fresh process: RUSAGE_CHILDREN is per process tree
        cmd = [sys.executable, __file__, "--child", kind, "--prep", str(prep), "--work", str(work),
               "--model", args.model, "--processes", str(args.processes), "--steps", str(args.steps),
               "--batch", str(args.batch), "--device", args.device]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
        results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    cmd = " ".join(["benchmarks/fsdp_memory.py", "--model", args.model, "--processes", str(args.processes),
                    "--steps", str(args.steps), "--batch", str(args.batch), "--device", args.device])
    for kind, r in results.items():
        step = f"{r['step_s']:.3f} s/step" if r["step_s"] is not None else "n/a"
        print(f"- {args.device} {args.model} SFT {args.processes} processes {kind}: peak RSS per process "
              f"{r['peak_rss_mib']:.0f} MiB, parameters per process {r['parameters_per_process']:,} of "
              f"{r['total_parameters']:,}, {step}, final loss {r['final_loss']:.4f} (command: {cmd})")
    ratio = results["ddp"]["peak_rss_mib"] / results["fsdp"]["peak_rss_mib"]
    print(f"- {args.device} {args.model} SFT {args.processes} processes: peak RSS per process ddp / fsdp: "
          f"ratio {ratio:.2f}x (command: {cmd})")


if __name__ == "__main__":
    main()
