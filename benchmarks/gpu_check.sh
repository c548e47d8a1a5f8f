#!/usr/bin/env bash
# The one-shot GPU check (benchmarks/gpu_check.py): on a lent GPU machine, after `make gpu-wheels` here,
#     bash benchmarks/gpu_check.sh --device cuda
# installs the carried wheels (.whl/, benchmarks/gpu_wheels.py install) into $SITE (default /tmp/site), puts
# them on PYTHONPATH and runs the parts: CUDA tests, GRPO r1flow vs TRL, generation, SFT/DPO. Everything
# goes under $OUT (gpu_check.log, summary.json, summary.md, suite.json). The CPU smoke run (CI):
#     PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --device cpu --quick
# installs nothing unless --install-wheels is given. PYTHON (default python3) runs everything.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
export OUT PYTHONUNBUFFERED=1
mkdir -p "$OUT"
device=cuda install=auto prev="" args=()
for a in "$@"; do
  case "$a" in
    --install-wheels) install=yes ;;
    --no-install-wheels) install=no ;;
    *) args+=("$a") ;;
  esac
  [ "$prev" = "--device" ] && device=$a
  case "$a" in --device=*) device=${a#--device=} ;; esac
  prev=$a
done
if [ "$install" = auto ]; then
  if [ "$device" = cuda ] && [ -d "${WHEELS:-.whl}" ]; then install=yes; else install=no; fi
fi
if [ "$install" = yes ]; then
  SITE=${SITE:-/tmp/site}
  echo "=== installing the carried wheels from ${WHEELS:-.whl} into $SITE" | tee -a "$OUT/gpu_check.log"
  t0=$(date +%s)
  "$PYTHON" benchmarks/gpu_wheels.py install --wheels "${WHEELS:-.whl}" --target "$SITE" 2>&1 | tee -a "$OUT/gpu_check.log"
  echo "=== wheels: exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_check.log"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT" "${args[@]}"
