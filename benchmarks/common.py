"""Pieces the benchmarks share: stage inputs without a store, peak-memory meter, allocator settings,
synthetic data, shapes.

Kept free of TRL so the r1flow-only benchmarks (dpo.py, grpo_step.py, generation.py) run in the
project venv; the TRL side lives in trl_side.py and is imported only in the benchmark venv.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stages.runtime.host_memory import KEEP_BYTES  # noqa: E402  (ctypes only: no torch)

CACHE_DIR = ROOT / ".r1flow" / "cache-models"
MODEL_REFS = {"tiny": "tiny-random", "smollm2": "smollm2-135m-instruct", "1b": "llama-1b-random"}
SEED = 0  # r1flow's context seed in the suite: its GRPO stage picks each step's prompts from it
# SmolLM2-135M's architecture and tokenizer with random weights, for speed on a GPU machine that lacks the
# GGUF (build_smollm2_random); the ref is the directory it is built in, which import_model takes as it is.
MODEL_REFS["smollm2-random"] = str(CACHE_DIR / "bench" / "smollm2-random")
GPU_DIR = ROOT / ".gpu"  # made by `make gpu-wheels` (git-ignored) and carried to a lent GPU machine
SMOLLM2_CONFIG_DIR = GPU_DIR / "smollm2-config"


# ---------------------------------------------------------------------------- stage inputs


def stage_input(output, parents: list[str] | None = None):
    """An `Input` for a stage output that was never published: fingerprint = sha256 of its path.

    The same path gives the same fingerprint in every process, so a `reference_logprobs` output
    made in one subprocess is accepted by `preference_optimization` in another (it checks parents).
    """
    from schemas.artifacts import Manifest, Producer
    from stages.base import Input

    manifest = Manifest(kind=output.kind, schema=output.schema, fingerprint=path_fingerprint(output.path), files={},
                        rows=output.rows, parents=parents or [], metrics=output.metrics,
                        producer=Producer(stage="benchmark", stage_version="0", config_hash=""))
    return Input(Path(output.path), manifest)


def path_fingerprint(path: Path | str) -> str:
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()


# ---------------------------------------------------------------------------- learning curves


class Snapshots:
    """Saves the policy's adapter after the steps that cross each curve time (seconds of training), and after
    step `at_step`, or with `every_step` after every step as "step<N>" (the equal-steps point of a run made before
    the run that sets it; learning.py keeps the one it needs and deletes the rest). Both sides of `learning.py`
    use it: r1flow's stage and TRL's trainer (trl_side.py)."""

    def __init__(self, curve_times: list[float], out: Path, at_step: int | None, every_step: bool = False):
        self.times, self.out, self.at_step, self.every_step = list(curve_times), out, at_step, every_step
        self.saved: list[dict] = []
        self.crossed = 0

    def after_step(self, model, step: int, elapsed: float) -> None:
        names = []
        while self.times and elapsed >= self.times[0]:
            self.times.pop(0)
            self.crossed += 1
            names.append(f"t{self.crossed}")
        if self.at_step is not None and step == self.at_step:
            names.append("equal_steps")
        if self.every_step:
            names.append(f"step{step}")
        for name in names:
            path = self.out / name
            t0 = time.perf_counter()
            model.save_pretrained(str(path))
            self.saved.append({"name": name, "step": step, "elapsed_s": elapsed, "adapter": str(path),
                               "save_s": time.perf_counter() - t0})


# ---------------------------------------------------------------------------- memory


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of a window of this process, in MiB.

    CPU: the resident-set high-water mark (VmHWM) is reset at `start()` (Linux: writing 5 to
    /proc/self/clear_refs), so the peak belongs to the window only; `delta_mib` is that peak minus
    the RSS at `start()`. Without /proc the process-lifetime ru_maxrss is used instead.
    GPU: torch.cuda.max_memory_allocated over the window, minus what was allocated at `start()`.
    """

    def __init__(self, device: str):
        self.device = device
        self.start_mib = 0.0
        self.reset_ok = False

    def start(self) -> None:
        import gc

        warm_imports()
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.start_mib = torch.cuda.memory_allocated() / 2**20
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False
        rss = _proc_status_kib("VmRSS")
        self.start_mib = (rss or 0) / 1024

    def peak_mib(self) -> float:
        if self.device.startswith("cuda"):
            import torch

            return torch.cuda.max_memory_allocated() / 2**20
        hwm = _proc_status_kib("VmHWM") if self.reset_ok else None
        return (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024

    def result(self) -> dict[str, float]:
        peak = self.peak_mib()
        return {"peak_mib": peak, "peak_delta_mib": peak - self.start_mib, "start_mib": self.start_mib}


def warm_imports() -> None:
    """Import what either side would otherwise import lazily inside the window (model classes, the
    optimizer, safetensors, parquet), so module import memory is not counted as training memory."""
    import pyarrow.dataset  # noqa: F401  (pq.read_table imports it on first use, and it imports pandas)
    import pyarrow.parquet  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch.optim  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


# ---------------------------------------------------------------------------- allocator


class UnfairComparison(RuntimeError):
    """The two sides of a comparison did not run under the same conditions (allocator, prompts)."""


# glibc's malloc settings every child of the suite gets, the same for r1flow and TRL. r1flow's own in-process
# tuning (stages/runtime/host_memory.py, mallopt while run_stage runs a CPU stage) is off in both modes: `tuned` gives
# both sides host_memory's thresholds (1 GiB) through the environment, `glibc` leaves both at glibc's defaults.
# glibc 2.36 takes 1 GiB from the environment as from mallopt (no 32 MiB cap): 48 and 160 MiB blocks come from the
# heap and stay there once freed (`heap_probe`); a 160 MiB tensor made again faults 0 pages (40,961 with defaults).
ALLOCATOR_MODES: dict[str, dict[str, str]] = {
    "tuned": {"MALLOC_MMAP_THRESHOLD_": str(KEEP_BYTES), "MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES),
              "R1FLOW_MALLOC_TUNING": "0"},
    "glibc": {"R1FLOW_MALLOC_TUNING": "0"},
}
REPORTED_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "R1FLOW_MALLOC_TUNING",
                 "LD_PRELOAD")
PROBE_MIB = (48, 160)  # above glibc's largest dynamic mmap threshold (32 MiB); above SmolLM2's 113 MB gradient


def allocator_env(mode: str, environ: dict[str, str]) -> dict[str, str]:
    """`environ` with the allocator variables of `mode`: what every child of the suite runs with.

    A MALLOC_* variable or a glibc.malloc tunable of the caller's own is refused unless the mode sets
    the same value: it would be one more setting, and the suite states only the mode's.
    """
    wanted = ALLOCATOR_MODES[mode]
    own = {k: v for k, v in environ.items() if k.startswith("MALLOC_") and wanted.get(k) != v}
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        own["GLIBC_TUNABLES"] = environ["GLIBC_TUNABLES"]
    if own:
        raise UnfairComparison(f"allocator settings in the environment {own} are not those of --allocator {mode} "
                               f"({wanted}); unset them, or pick the mode that sets them")
    return {**{k: v for k, v in environ.items() if k != "R1FLOW_MALLOC_TUNING"}, **wanted}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_probe() -> dict[str, bool | None]:
    """Where glibc puts a block of each PROBE_MIB size now: from the heap or a fresh mmap (`mallinfo2`'s
    mmapped bytes), and whether the heap keeps it once freed (its size from sbrk does not shrink).

    Nothing is written to the blocks, so no page becomes resident. None off glibc (or before 2.33).
    """
    from stages.runtime.host_memory import _glibc

    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {f"heap_serves_{m}MiB": None for m in PROBE_MIB} | {f"heap_keeps_freed_{PROBE_MIB[-1]}MiB": None}
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    out: dict[str, bool | None] = {}
    for mib in PROBE_MIB:
        mapped = libc.mallinfo2().hblkhd
        block = libc.malloc(mib << 20)
        from_heap = libc.mallinfo2().hblkhd - mapped < mib << 20
        arena = libc.mallinfo2().arena
        libc.free(block)
        out[f"heap_serves_{mib}MiB"] = from_heap
        if mib == PROBE_MIB[-1]:
            out[f"heap_keeps_freed_{mib}MiB"] = libc.mallinfo2().arena >= arena if from_heap else None
    return out


def allocator_report(in_process_tuning: bool) -> dict:
    """The allocator setting this process runs under: its variables, whether r1flow's host_memory raised
    glibc's thresholds itself, and what glibc does with large blocks (`heap_probe`)."""
    return {"env": {k: os.environ.get(k) for k in REPORTED_VARS}, "in_process_tuning": in_process_tuning,
            **heap_probe()}


class AllocatorProbe:
    """Within the block, every `host_memory.reuse_freed_memory` (the one `run_stage` enters around a CPU
    stage) also takes an `allocator_report` inside itself, where the stage trains. `report()` is the first
    of those, or the process's own when no stage ran (TRL's side). It only observes: nothing changes."""

    def __init__(self):
        self.stage_reports: list[dict] = []

    def __enter__(self):
        from contextlib import contextmanager

        from stages.runtime import host_memory

        original = self._original = host_memory.reuse_freed_memory

        @contextmanager
        def observed(device):
            with original(device) as kept:
                self.stage_reports.append(allocator_report(bool(kept)))
                yield kept

        host_memory.reuse_freed_memory = observed
        return self

    def __exit__(self, *exc):
        from stages.runtime import host_memory

        host_memory.reuse_freed_memory = self._original

    def report(self) -> dict:
        return self.stage_reports[0] if self.stage_reports else allocator_report(False)


def check_same_allocator(reports: dict[str, dict | None]) -> dict:
    """The one allocator setting of several children (label -> its report); UnfairComparison if they differ."""
    seen = {label: r for label, r in reports.items() if r is not None}
    if not seen:
        return {}
    (first_label, first), *rest = seen.items()
    for label, r in rest:
        if r != first:
            diff = {k: (first.get(k), r.get(k)) for k in sorted(set(first) | set(r)) if first.get(k) != r.get(k)}
            raise UnfairComparison(f"{first_label} and {label} ran under different allocator settings "
                                   f"({first_label}, {label}): {diff}; the suite compares only equal settings")
    return first


def describe_allocator(mode: str, report: dict) -> str:
    """One line: the mode, its variables and what glibc was seen to do with them."""
    env = " ".join(f"{k}={v}" for k, v in report.get("env", {}).items() if v is not None) or "no allocator variables"
    probe = ", ".join(f"a {k.split('_', 2)[-1][:-3]} MiB block: {'yes' if v else 'no'}"
                      for k, v in report.items() if k.startswith("heap_serves") and v is not None)
    seen = f"; glibc's heap serves {probe}" if probe else ""
    own = "; r1flow tuned in-process" if report.get("in_process_tuning") else ""
    return f"allocator {mode}, the same for r1flow and TRL: {env}{seen}{own}"


# ---------------------------------------------------------------------------- synthetic text

WORDS = ("the of and to in is that for it as with was on be by this are from at or an which one two three "
         "four five six seven eight nine ten add sum total number value first second result step check").split()


def exact_text(tokenizer, n_tokens: int, rng: random.Random, tries: int = 50) -> str:
    """Random words whose tokenization is exactly n_tokens tokens (best effort after `tries`)."""
    best = ""
    for _ in range(tries):
        text = " ".join(rng.choice(WORDS) for _ in range(n_tokens + 8))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
        cut = tokenizer.decode(ids, skip_special_tokens=True).strip()
        if len(tokenizer(cut, add_special_tokens=False)["input_ids"]) == n_tokens:
            return cut
        best = cut
    return best


def sft_rows(tokenizer, n: int, prompt_tokens: int, completion_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"s{i}", "source": "bench", "metadata": "{}",
             "messages": [{"role": "user", "content": exact_text(tokenizer, prompt_tokens, rng)},
                          {"role": "assistant", "content": exact_text(tokenizer, completion_tokens, rng)}]}
            for i in range(n)]


def preference_rows(tokenizer, n: int, prompt_tokens: int, completion_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"p{i}", "source": "bench", "chosen_score": 1.0, "rejected_score": 0.0,
             "messages": [{"role": "user", "content": exact_text(tokenizer, prompt_tokens, rng)}],
             "chosen": exact_text(tokenizer, completion_tokens, rng),
             "rejected": exact_text(tokenizer, completion_tokens, rng)}
            for i in range(n)]


# ---------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration, applied identically to r1flow and TRL."""

    sft_batch: int
    sft_prompt_tokens: int
    sft_completion_tokens: int
    dpo_batch: int  # pairs per step (one micro-batch: 2 * dpo_batch sequences per forward)
    dpo_prompt_tokens: int
    dpo_completion_tokens: int
    grpo_prompts: int
    grpo_group: int
    grpo_new_tokens: int
    grpo_minibatch: int  # sequences per forward/backward; prompts * group / minibatch micro-batches per step
    sft_steps: int  # warm (timed) steps; one more warm-up step is run first and not timed
    dpo_steps: int
    grpo_steps: int
    max_length: int = 1024  # truncation limit for sft/dpo (set above every sequence: nothing is truncated)
    lora_r: int = 0
    learning_rate: float = 1e-6
    cache: str = "dynamic"  # KV cache of GRPO's generate() on both sides: dynamic (both defaults) or static
    r1flow_backend: str = "transformers"  # r1flow's GRPO generation backend (vllm: colocated, CUDA); TRL's stays transformers

    def to_dict(self) -> dict:
        return asdict(self)


SHAPES: dict[tuple[str, str], Shape] = {
    ("cpu", "tiny"): Shape(sft_batch=8, sft_prompt_tokens=32, sft_completion_tokens=96, dpo_batch=4,
                           dpo_prompt_tokens=32, dpo_completion_tokens=64, grpo_prompts=4, grpo_group=4,
                           grpo_new_tokens=32, grpo_minibatch=16, sft_steps=20, dpo_steps=20, grpo_steps=8),
    ("cpu", "smollm2"): Shape(sft_batch=4, sft_prompt_tokens=32, sft_completion_tokens=96, dpo_batch=2,
                              dpo_prompt_tokens=32, dpo_completion_tokens=64, grpo_prompts=4, grpo_group=4,
                              grpo_new_tokens=32, grpo_minibatch=16, sft_steps=8, dpo_steps=8, grpo_steps=5),
    ("cuda", "tiny"): Shape(sft_batch=16, sft_prompt_tokens=64, sft_completion_tokens=448, dpo_batch=8,
                            dpo_prompt_tokens=64, dpo_completion_tokens=192, grpo_prompts=16, grpo_group=8,
                            grpo_new_tokens=128, grpo_minibatch=16, sft_steps=10, dpo_steps=10, grpo_steps=5),
    ("cuda", "smollm2"): Shape(sft_batch=16, sft_prompt_tokens=64, sft_completion_tokens=448, dpo_batch=8,
                               dpo_prompt_tokens=64, dpo_completion_tokens=192, grpo_prompts=16, grpo_group=8,
                               grpo_new_tokens=128, grpo_minibatch=16, sft_steps=10, dpo_steps=10, grpo_steps=5),
    ("cuda", "1b"): Shape(sft_batch=8, sft_prompt_tokens=64, sft_completion_tokens=448, dpo_batch=4,
                          dpo_prompt_tokens=64, dpo_completion_tokens=192, grpo_prompts=16, grpo_group=8,
                          grpo_new_tokens=128, grpo_minibatch=16, sft_steps=5, dpo_steps=5, grpo_steps=3),
}


# The second GRPO shape (issue 25), closer to real use: 8 sampled completions of up to 128 tokens a prompt, where
# a run of the shared prompt saves less than at 4 x 32. Few steps: a TRL step of SmolLM2 takes minutes on 2 cores.
# None on CUDA, whose GRPO shape is already 16 x 8 x 128.
LONG_GRPO: dict[tuple[str, str], dict[str, int]] = {
    ("cpu", "tiny"): {"grpo_prompts": 4, "grpo_group": 8, "grpo_new_tokens": 128, "grpo_minibatch": 16, "grpo_steps": 2},
    ("cpu", "smollm2"): {"grpo_prompts": 4, "grpo_group": 8, "grpo_new_tokens": 128, "grpo_minibatch": 16,
                         "grpo_steps": 2},
}


def grpo_long_shape(shape: Shape, device: str, model: str, quick: bool = False) -> Shape | None:
    """`shape` with LONG_GRPO's GRPO fields (None where the model has no long shape on this device);
    quick: one timed step."""
    long = LONG_GRPO.get(("cuda" if device.startswith("cuda") else "cpu", model))
    if long is None:
        return None
    shape = replace(shape, **long)
    return replace(shape, grpo_steps=1) if quick else shape


def shape_for(device: str, model: str, quick: bool = False, lora_r: int = 0, cache: str = "dynamic",
              r1flow_backend: str = "transformers") -> Shape:
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if (kind, model) not in SHAPES:
        raise SystemExit(f"no benchmark shape for model {model!r} on {kind} (known: "
                         f"{sorted(m for d, m in SHAPES if d == kind)})")
    shape = replace(SHAPES[(kind, model)], lora_r=lora_r, cache=cache, r1flow_backend=r1flow_backend)
    if quick:
        shape = replace(shape, sft_steps=min(shape.sft_steps, 3), dpo_steps=min(shape.dpo_steps, 3),
                        grpo_steps=min(shape.grpo_steps, 2))
    return shape


# ---------------------------------------------------------------------------- models


def ensure_model_dir(name: str) -> Path:
    """The HF directory of a benchmark model: builtins via stages.modeling.models, the ~1B random Llama built here."""
    from stages.modeling import models

    ref = MODEL_REFS[name]
    if name == "smollm2-random":
        return build_smollm2_random(Path(ref))
    if ref in models.BUILTIN_MODELS:
        return Path(models.resolve_model_dir(ref, CACHE_DIR))
    return build_llama_1b(CACHE_DIR / "bench" / ref)


def build_llama_1b(dest: Path) -> Path:
    """A randomly initialised ~1.0B-parameter Llama with SmolLM2's tokenizer (GPU benchmarks only).

    hidden 2048, 20 layers, 32 heads (8 KV heads), MLP 5632, tied embeddings: 1.00B parameters.
    """
    if (dest / "config.json").is_file():
        return dest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.modeling import models

    _, tokenizer = models.load_model(ensure_model_dir("smollm2"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    models.save_model(model, tokenizer, tmp)
    tmp.rename(dest)
    return dest


# the random-weight SmolLM2 runs SmolLM2's shapes
SHAPES.update({(kind, "smollm2-random"): SHAPES[(kind, "smollm2")] for kind in ("cpu", "cuda")})

# what a model directory holds besides its weights: enough to rebuild SmolLM2 with random weights
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")


def export_smollm2_config(dest: Path = SMOLLM2_CONFIG_DIR) -> Path:
    """SmolLM2-135M-Instruct's config and tokenizer files (no weights, ~3.5 MB) copied into `dest`, from the
    HF directory converted from its GGUF: what `build_smollm2_random` needs where the GGUF is not."""
    import shutil

    source = ensure_model_dir("smollm2")
    dest.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return dest


def build_smollm2_random(dest: Path, config_dir: Path | None = None) -> Path:
    """SmolLM2-135M's exact config and real tokenizer with random weights (seed 0), saved as a model directory.

    Speed needs no trained weights (docs/design.md §6): a GPU machine builds this from the carried config
    directory (`SMOLLM2_CONFIG_DIR`, made by `make gpu-wheels`); elsewhere the config is exported from the
    GGUF conversion first. The weights are near-uniform over the vocabulary, so sampled completions stop at
    an EOS only rarely (about max_new_tokens / vocabulary per row) and run to their maximum length.
    """
    if (dest / "config.json").is_file():
        return dest
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from stages.modeling import models

    if config_dir is None:
        config_dir = SMOLLM2_CONFIG_DIR
        if not (config_dir / "config.json").is_file():
            export_smollm2_config(config_dir)
    config = AutoConfig.from_pretrained(config_dir)
    tokenizer = AutoTokenizer.from_pretrained(config_dir)  # saved by save_model: pad token and padding side set
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    models.save_model(model, tokenizer, tmp)
    tmp.rename(dest)
    return dest


# ---------------------------------------------------------------------------- statistics


def warm(values: list[float], skip: int = 1) -> list[float]:
    """Drop the first `skip` measurements (compilation, allocator and cache warm-up)."""
    return list(values[skip:])


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")
