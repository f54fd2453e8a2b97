#!/usr/bin/env bash
# train-step --keep-activations: step time and peak memory against the number of layers kept
# (docs/benchmarks.md, train-step). Each row is one bench_train.py subprocess on an empty GPU.
#   bash benchmarks/sweep_keep_activations.sh OUT_DIR
set -u
out=${1:?usage: sweep_keep_activations.sh OUT_DIR}
mkdir -p "$out"
run() {  # run CONFIG MICRO_BATCH_TOKENS KEEP [bench_train flags...]
  local d="$out/$1-mb$2-keep$3${4:+-recipe}"
  python benchmarks/bench_train.py --configs "$1" --steps 2 --micro-batch-tokens "$2" --keep-activations "$3" \
    --timeout 190 --out "$d" "${@:4}" > "$d.log" 2>&1
  grep -h "^| $1" "$d/bench_train.md" 2>/dev/null || echo "| $1 mb=$2 keep=$3 | failed: see $d.log |"
  grep -h "keep-activations auto:" "$d/bench_train_$1.log" 2>/dev/null
}
if [ "${RECIPE_ONLY:-0}" != 1 ]; then
  for keep in 0 28 auto; do run 7b-nvfp4 8192 $keep; done
  for keep in 0 auto; do run 7b-nvfp4 24576 $keep; done
  for keep in 0 auto; do run 7b-bf16 8192 $keep; done
  for keep in 0 auto; do run 32b-nvfp4 8192 $keep; done
fi
# the recipes' memory flags (recipes/configs/qwen2.5-{7b,32b}-instruct.env) with auto
mem="--offload-activations --embeddings-on-cpu"
for keep in 0 auto; do run 7b-nvfp4 24576 $keep $mem; done
run 7b-nvfp4 8192 auto $mem
for keep in 0 auto; do run 32b-nvfp4 8192 $keep $mem; done
