#!/usr/bin/env bash
# The paper's claim at small scale: the same GRPO loop three ways, several seeds each, equal steps.
#   16-bit LoRA (bf16 base) | NVFP4 LoRA | NVFP4 LoRA + AQN
#
#   bash recipes/compare_aqn.sh [OUT_DIR] [CONFIG]      (defaults: runs/compare, recipes/configs/tiny.env)
#
# Runs PARALLEL loops at once (default: cores / 2), each with THREADS torch threads, then
# writes OUT_DIR/results.md and OUT_DIR/curves.png (python recipes/plot_compare.py OUT_DIR).
# SEEDS (default "0 1 2"), STEPS and every other knob of the config can be set in the environment;
# EXTRA_AQN=START:END adds a fourth variant with a larger noise schedule. Finished runs are kept:
# rerunning with more variants only runs the new ones (every stage says "already done").
# The NVFP4 base and each base policy's eval are the same for every seed and variant, so they are made
# once, in OUT_DIR/shared-nvfp4 and OUT_DIR/shared-bf16 (STEPS=0 runs of grpo.sh), and each run directory
# gets hard links to them, where its own quantize and base eval then read "already done".
set -euo pipefail
here=$PWD
cd "$(dirname "$0")/.."
# shellcheck source=recipes/lib.sh
source recipes/lib.sh  # qerl_run_forwarding: a signal to this script stops what it runs
qerl_help_if_asked recipes/compare_aqn.sh "${1:-}"
# Paths you pass are read where you ran the command; the defaults live in the repository.
abs() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$here" "$1" ;; esac; }
OUT=${1:+$(abs "$1")}; OUT=${OUT:-runs/compare}
CONFIG=${2:+$(abs "$2")}; CONFIG=${CONFIG:-recipes/configs/tiny.env}
SEEDS=${SEEDS:-0 1 2}
# The cores, not OMP_NUM_THREADS: GNU nproc prints that variable when it is set, so OMP_NUM_THREADS=1 (a shared
# machine's advice, README) ran one loop at a time, and OMP_NUM_THREADS=16 eight loops on a 2-core VM (s59r07).
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
PARALLEL=${PARALLEL:-$(( cores / 2 > 0 ? cores / 2 : 1 ))}
export OMP_NUM_THREADS=${THREADS:-2} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

jobs=()
for seed in $SEEDS; do
  jobs+=("bf16-lora $seed bf16 0" "nvfp4-lora $seed nvfp4 0" "nvfp4-aqn $seed nvfp4 ${AQN_SIGMA_START:-1e-2}")
  # EXTRA_AQN="0.1:1e-3": also run NVFP4 + AQN with a larger schedule (sigma_start:sigma_end)
  if [ -n "${EXTRA_AQN:-}" ]; then jobs+=("nvfp4-aqn-${EXTRA_AQN%%:*} $seed nvfp4 ${EXTRA_AQN%%:*} ${EXTRA_AQN##*:}"); fi
done
# Once per base format, before the runs: a run quantized and scored its own copy (9 copies for 3 seeds).
for fmt in nvfp4 bf16; do
  STEPS=0 BASE_FORMAT=$fmt qerl_run_forwarding bash recipes/grpo.sh "$CONFIG" "$OUT/shared-$fmt" >> "$OUT/shared-$fmt.log" 2>&1 \
    || { echo "FAILED: the shared $fmt base (see $OUT/shared-$fmt.log)"; exit 1; }
done
link_shared() {  # RUN_DIR BASE_FORMAT: hard links (a copy across file systems) to what the run shares
  local name
  mkdir -p "$1"
  for name in base eval-base; do
    [ -d "$OUT/shared-$2/$name" ] || continue
    # The shared one was redone (FORCE=1 after a change) and this run has taken no step on the old one:
    # link the new one (else the run redid it itself). A run with steps keeps what its steps were made on.
    if [ -e "$1/$name" ] && ! cmp -s "$1/$name/manifest.json" "$OUT/shared-$2/$name/manifest.json" \
        && ! compgen -G "$1/step-*" > /dev/null; then
      rm -rf "${1:?}/$name"
    fi
    if [ ! -e "$1/$name" ]; then
      cp -al "$OUT/shared-$2/$name" "$1/$name" 2>/dev/null \
        || { rm -rf "${1:?}/$name"; cp -a "$OUT/shared-$2/$name" "$1/$name"; }
    fi
  done
}
run_one() {  # NAME SEED BASE_FORMAT SIGMA_START [SIGMA_END]
  local dir=$OUT/$1-s$2
  link_shared "$dir" "$3"
  BASE_FORMAT=$3 AQN_SIGMA_START=$4 AQN_SIGMA_END=${5:-${AQN_SIGMA_END:-1e-4}} SEED=$2 \
    bash recipes/grpo.sh "$CONFIG" "$dir" >> "$dir.log" 2>&1 || { echo "FAILED: $dir (see $dir.log)"; return 1; }
  echo "done: $dir"
}
export -f run_one link_shared; export OUT CONFIG
printf '%s\n' "${jobs[@]}" > "$OUT/.jobs"
# xargs through a relay: a bash running it as qerl_run_forwarding does, which passes a signal on to xargs and every
# run, and so the SIGTERM it gets when this script dies (xargs itself would die of it alone, its runs going on).
# shellcheck disable=SC2016  # the relay's own "$@"
qerl_run_forwarding bash -c 'source recipes/lib.sh; qerl_run_forwarding "$@"' relay \
  xargs -a "$OUT/.jobs" -P "$PARALLEL" -I{} bash -c 'run_one {}'  # a signal, or this script's death, stops every run
python recipes/plot_compare.py "$OUT"
