#!/bin/bash
# Template of the `vllm` command of the vLLM entrypoint bench: bench/vllm_entrypoint_tests.py fills in
# @SERVETWIN@ (the servetwin executable) and @SHIM_LOG@ and writes it to WORKDIR/bin/vllm, first on the
# tests' PATH. vLLM's RemoteOpenAIServer runs `vllm serve MODEL ARGS...`; this runs
#   servetwin serve --model default --served-model-name MODEL --device cpu ARGS...
# i.e. the default model under the test's model name, every other argument passed through unchanged.
# If ARGS already name --served-model-name, those names are kept and MODEL is not added.
SERVETWIN=@SERVETWIN@
LOG=@SHIM_LOG@
if [ "$1" != "serve" ]; then
  echo "servetwin bench shim: only 'vllm serve' is supported, got: vllm $*" | tee -a "$LOG" >&2
  exit 2
fi
shift
MODEL="$1"; shift
names=(--served-model-name "$MODEL")
for a in "$@"; do
  case "$a" in --served-model-name|--served-model-name=*) names=();; esac
done
# the test process's PYTHONPATH (the vLLM source tree) must not leak into servetwin's environment
unset PYTHONPATH
echo "$(date +%T) [${PYTEST_CURRENT_TEST:-?}] $SERVETWIN serve --model default ${names[*]} --device cpu $*" >> "$LOG"
exec "$SERVETWIN" serve --model default "${names[@]}" --device cpu "$@"
