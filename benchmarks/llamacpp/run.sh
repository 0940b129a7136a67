#!/usr/bin/env bash
# llama.cpp against dsjax on engine_bench's model, in one sitting, on this machine:
#   1. build.sh: llama.cpp from the llama-cpp-python sdist (GGML_NATIVE=ON), outside the repo;
#   2. bench.py prepare: engine_bench's checkpoint -> f32 / bf16 GGUF, and the agreement of
#      llama.cpp's logits and greedy tokens with dsjax's on it;
#   3. llama.cpp measured, engine_bench run (dsjax fp32 / 16-bit, HF), llama.cpp measured again;
#   4. bench.py combine -> benchmarks/results/llamacpp_<TAG>.json (engine_bench's own JSON of the
#      sitting: engine_<TAG>_llamacpp.json); report.py -> REPORT.md.
#
#   benchmarks/llamacpp/run.sh [WORK_DIR]     (default: $LLAMA_BUILD or /work/llama_build)
#
# Env: TAG (cpu_bench78m), THREADS (2), REPS (llama.cpp repetitions, 5), ENGINE_ARGS (more
# engine_bench flags), SDIST / LLAMA_CPP_PYTHON_VERSION / JOBS (build.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${1:-${LLAMA_BUILD:-/work/llama_build}}"
TAG="${TAG:-cpu_bench78m}"
THREADS="${THREADS:-2}"
REPS="${REPS:-5}"
mapfile -t BUILT < <(benchmarks/llamacpp/build.sh "$WORK" | tail -n 2)
SRC="${BUILT[0]}"
BIN="${BUILT[1]}"
SDIST="$(cd "$SRC/../.." && pwd)"
MODEL_DIR="$WORK/models-bench78m"
mkdir -p "$MODEL_DIR"
rm -f "$MODEL_DIR"/llama_*.json
echo "== $(date -u +%FT%TZ) $(uptime)"
python benchmarks/llamacpp/bench.py prepare --work "$MODEL_DIR" --llama-src "$SRC" --sdist "$SDIST" --bin "$BIN"
python benchmarks/llamacpp/bench.py measure --work "$MODEL_DIR" --bin "$BIN" --round before \
  --threads "$THREADS" --reps "$REPS"
echo "== $(date -u +%FT%TZ) $(uptime)"
# shellcheck disable=SC2086
python benchmarks/engine_bench.py --config bench-78m --batches 1,8 --new-tokens 64 \
  --out "benchmarks/results/engine_${TAG}_llamacpp.json" ${ENGINE_ARGS:-}
echo "== $(date -u +%FT%TZ) $(uptime)"
python benchmarks/llamacpp/bench.py measure --work "$MODEL_DIR" --bin "$BIN" --round after \
  --threads "$THREADS" --reps "$REPS"
python benchmarks/llamacpp/bench.py combine --work "$MODEL_DIR" \
  --engine-json "benchmarks/results/engine_${TAG}_llamacpp.json" --out "benchmarks/results/llamacpp_$TAG.json"
python benchmarks/report.py
