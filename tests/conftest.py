"""Test session setup: every test session gets its own R1FLOW_HOME and PREFECT_HOME (set before
Prefect is imported; prefect_test_harness does not isolate result storage, docs/design.md §6)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

_SESSION = Path(tempfile.mkdtemp(prefix="r1flow-tests-"))
os.environ["R1FLOW_HOME"] = str(_SESSION / "home")
os.environ["PREFECT_HOME"] = str(_SESSION / "prefect")
# and what Prefect keeps there (Prefect 3.7 derives results' folder from ~/.prefect, not PREFECT_HOME)
from flows.servers.settings import PREFECT_HOME_FILES  # noqa: E402

for _var, _name in PREFECT_HOME_FILES.items():
    os.environ[_var] = str(_SESSION / "prefect" / _name)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the suite always runs beside itself (stages/runtime/threads.py)
from stages.runtime.threads import reproducible_products  # noqa: E402

reproducible_products()  # as the CLI does, before torch's first product: outputs independent of the thread count
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("R1FLOW_STORE", None)

import contextlib  # noqa: E402
import queue  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@contextlib.contextmanager
def harness_home(path: Path):
    """R1FLOW_HOME=path under one Prefect test server (for a module's end-to-end runs)."""
    from prefect.testing.utilities import prefect_test_harness

    old = os.environ.get("R1FLOW_HOME")
    os.environ["R1FLOW_HOME"] = str(path)
    try:
        with prefect_test_harness(server_startup_timeout=120):
            yield path
    finally:
        if old is None:
            os.environ.pop("R1FLOW_HOME", None)
        else:
            os.environ["R1FLOW_HOME"] = old


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment for a CLI subprocess, without the servers, home or Ray cluster of the shell that
    runs the tests, with R1FLOW_HOME=home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "R1FLOW_", "RAY_"))}
    env.update({"R1FLOW_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from stages.modeling.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    from stages.modeling.models import build_tiny_model

    return build_tiny_model(tiny_tokenizer, seed=0)


def assert_matches_whole_rows(model, got, ent, ref, ref_ent, mask, ref_grads) -> None:
    """Shared-prefix log-probs and entropies equal the whole rows' at the scored positions (0 elsewhere),
    and backpropagating their masked sum gives the whole rows' parameter gradients (`ref_grads`)."""
    import torch

    assert got.shape == mask.shape and (got[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
    torch.testing.assert_close(got[mask > 0], ref[mask > 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[mask > 0], ref_ent[mask > 0], rtol=1e-5, atol=1e-5)
    (got * mask).sum().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def fake_input(path: Path, kind: str, schema: str, rows: int | None = None):
    """An Input for a directory laid out like an artifact, without a store."""
    from schemas.artifacts import Manifest, Producer
    from stages.base import Input

    fp = hashlib.sha256(str(path).encode()).hexdigest()
    return Input(Path(path), Manifest(kind=kind, schema=schema, fingerprint=fp, files={}, rows=rows,
                                      producer=Producer(stage="test", stage_version="0", config_hash="")))


@pytest.fixture(scope="session")
def tiny_model_input(session_dir, tiny_tokenizer):
    """A saved tiny model laid out like an import_model artifact (`<dir>/model/`)."""
    from schemas.artifacts import MODEL_DIR
    from stages.modeling.models import build_tiny_model, save_model

    path = session_dir / "tiny-model-artifact"
    if not path.exists():
        save_model(build_tiny_model(tiny_tokenizer, seed=0), tiny_tokenizer, path / MODEL_DIR)
    return fake_input(path, "model", "model")


@pytest.fixture(scope="session")
def live_servers(session_dir):
    """Prefect and MLflow servers (`flows.servers.servers.start`) on free 127.0.0.1 ports, started once per
    session under `<session>/servers-home` and stopped at teardown. Yields the ServerInfo;
    `flows.servers.servers.env_for(info)` gives PREFECT_API_URL and MLFLOW_TRACKING_URI."""
    from flows.servers import servers

    home = session_dir / "servers-home"
    info = servers.start(home)
    try:
        yield info
    finally:
        servers.stop(home)


@pytest.fixture()
def digit_prompts(tmp_path):
    """20 prompts "Say <digit>." (16 train, 4 eval), answered by the digit (exact match)."""
    from schemas.datasets import from_rows
    from stages.base import LocalContext, write_dataset

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say {i % 10}."}], "answer": str(i % 10),
             "task": "say", "verifier": "exact", "split": "train" if i < 16 else "eval", "metadata": "{}"}
            for i in range(20)]
    out = write_dataset(LocalContext(tmp_path / "p"), "p", from_rows(rows, "prompts"), "prompts")
    return fake_input(out.path, "dataset", "prompts")


class _FakeEngineModel:
    """vLLM's model inside the engine: load_weights takes (checkpoint name, tensor) pairs; its model runner's
    in-place `reload_weights(weights_iterator=...)` loads them the same way."""

    def __init__(self, hf):
        self.hf = hf
        self.pushes: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator):
        self.load_weights(weights_iterator)

    def get_model(self):
        return self.hf

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        got = {}
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"no parameter {name} in the engine's model")
            with torch.no_grad():
                params[name].copy_(tensor)
            got[name] = tensor.detach().clone()
        self.pushes.append(got)


class _FakeLLM:
    made: list[_FakeLLM] = []

    def __init__(self, model: str, seed: int = 0, gpu_memory_utilization: float = 0.9, **kwargs):
        self.seed, self.memory, self.kwargs = seed, gpu_memory_utilization, kwargs
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model).eval()
        self.inner = _FakeEngineModel(self.hf)
        self.worker = SimpleNamespace(model_runner=self.inner)
        self.shut_down = False
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: setattr(self, "shut_down", True)))
        self.resets, self.prompts, self.weights_at_generate = 0, [], []
        _FakeLLM.made.append(self)

    def reset_prefix_cache(self):
        self.resets += 1

    def collective_rpc(self, method, args=(), kwargs=None):
        """vLLM's: `method` (a callable) on each worker (here the one), as method(worker, *args, **kwargs)."""
        return [method(self.worker, *args, **(kwargs or {}))]

    def generate(self, prompts, params, use_tqdm=False):
        self.weights_at_generate.append({n: p.detach().clone() for n, p in self.hf.named_parameters()})
        outs = []
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        for p, request in zip(prompts, per_request, strict=True):
            torch.manual_seed(request.seed)  # one per request, as vLLM seeds each request's own generator
            self.prompts.append(list(p["prompt_token_ids"]))
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.no_grad():
                new = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                       max_new_tokens=request.max_tokens, num_return_sequences=request.n,
                                       pad_token_id=0)[:, ids.shape[1]:]
            # each sample stops after 1..max_tokens tokens (as if at an EOS), so lengths, and rewards on length, differ
            stops = torch.randint(1, request.max_tokens + 1, (len(new),)).tolist()
            outs.append(SimpleNamespace(outputs=[
                SimpleNamespace(text="x" * k, token_ids=row[:k].tolist(), finish_reason="stop", logprobs=None)
                for row, k in zip(new, stops, strict=True)]))
        return outs


class _FakeSamplingParams:
    def __init__(self, n=1, max_tokens=16, seed=None, **kwargs):
        self.n, self.max_tokens, self.seed, self.kwargs = n, max_tokens, seed, kwargs


@pytest.fixture()
def fake_vllm(monkeypatch):
    """A stand-in `vllm` module (LLM, SamplingParams) for the colocated-engine tests (vLLM needs CUDA): the engine
    samples from its own transformers copy of the model directory, loads weights by checkpoint name (an unknown
    name is an error), and records what it was given. Returns the LLM class (`.made`: the engines created)."""
    import sys
    import types

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = _FakeLLM, _FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    for name in ("vllm.model_executor", "vllm.model_executor.layers", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.cleanup_dist_env_and_memory = lambda: None
    monkeypatch.setitem(sys.modules, parallel_state.__name__, parallel_state)
    embedding = types.ModuleType("vllm.model_executor.layers.vocab_parallel_embedding")
    embedding.UnquantizedEmbeddingMethod = type("UnquantizedEmbeddingMethod", (), {})  # no layer of the fake has one
    monkeypatch.setitem(sys.modules, embedding.__name__, embedding)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # restored (unset) after the test
    _FakeLLM.made.clear()
    return _FakeLLM


def status_with_host(port: int, path: str, host_header: str) -> int:
    """The HTTP status of GET `path` on 127.0.0.1:`port` sent with `host_header` as its Host (a DNS-rebinding page's
    request names a foreign host)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host_header)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def read_until(proc: subprocess.Popen, done: Callable[[str], bool], timeout: float, what: str) -> list[str]:
    """stdout lines of proc (text mode, newline stripped) up to and including the first for which `done` is true. A
    thread reads the pipe: a process that prints nothing fails the test at the deadline instead of blocking it."""
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.rstrip("\n")) for x in iter(proc.stdout.readline, "")]
                     + [lines.put(None)], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if done(line):
            return seen
    raise AssertionError(f"{what}: not printed in {timeout:.0f} s:\n" + "\n".join(seen))

