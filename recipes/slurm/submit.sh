#!/usr/bin/env bash
# Submit a whole qerl RL run to Slurm as a chain of dependent jobs:
#   quantize -> [rollout array (ROLLOUT_SHARDS tasks) -> train] x STEPS -> final (merge + eval)
#
#   bash recipes/slurm/submit.sh CONFIG.env [RUN_DIR]
#
# Each rollout task writes its own shard directory (--shard-index/--num-shards), so a failed
# task can be rerun alone (`sbatch --array=3 ...`); every stage is idempotent, so resubmitting
# the whole chain after a failure redoes only what is missing (RUN_DIR/submit.env keeps every
# value of CONFIG as submitted, so a job rerun alone sees the chain's values). Variables (environment or
# CONFIG): PARTITION, ACCOUNT, ROLLOUT_SHARDS (default 1), ROLLOUT_GPUS (per task, 1),
# TRAIN_GPUS (1; >1 runs torchrun), GPU_GRES (gres name, default gpu; empty: no --gres, e.g. a
# CPU-only test cluster), TIME_ROLLOUT, TIME_TRAIN, TIME_QUANTIZE, EXTRA_SBATCH_ARGS.
# SBATCH=echo-like command replaces sbatch for a dry run (it must print a job id).
set -euo pipefail
CONFIG=${1:?usage: bash recipes/slurm/submit.sh CONFIG.env [RUN_DIR]}
[ -f "$CONFIG" ] || { echo "error: config $CONFIG not found" >&2; exit 2; }
# shellcheck disable=SC1090
source "$CONFIG"
RUN_DIR=${2:-${RUN_DIR:-runs/$(basename "$CONFIG" .env)}}
CONFIG=$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")
mkdir -p "$RUN_DIR"; RUN_DIR=$(cd "$RUN_DIR" && pwd)
SBATCH=${SBATCH:-sbatch}
HERE=$(cd "$(dirname "$0")" && pwd)
SCRIPT=$HERE/stage.sbatch
SHARDS=${ROLLOUT_SHARDS:-1}
# Every value the chain was submitted with, which the environment may have set (a config's
# ${VAR:-default}): a job rerun alone later (sbatch --array=3 ..., or the train job) must see the same
# ones, or it reads 1 of N shards, or samples other prompts with another G into the same step.
# stage.sbatch sources this file after CONFIG.
config_vars=$(grep -oE '^[[:space:]]*(export[[:space:]]+)?[A-Za-z_][A-Za-z0-9_]*=' "$CONFIG" \
  | sed -E 's/^[[:space:]]*(export[[:space:]]+)?//; s/=$//' | sort -u)
{
  echo "# written by submit.sh $(date -u +%FT%TZ): the chain's values; stage.sbatch reads it after CONFIG"
  for v in $config_vars; do declare -p "$v" 2>/dev/null || true; done
  printf 'ROLLOUT_SHARDS=%q\nSTEPS=%q\nTRAIN_GPUS=%q\n' "$SHARDS" "$STEPS" "${TRAIN_GPUS:-1}"
} > "$RUN_DIR/submit.env"

common=(--parsable --chdir "$PWD" --output "$RUN_DIR/slurm-%x-%A_%a.out")
[ -n "${PARTITION:-}" ] && common+=(--partition "$PARTITION")
[ -n "${ACCOUNT:-}" ] && common+=(--account "$ACCOUNT")
# shellcheck disable=SC2206
[ -n "${EXTRA_SBATCH_ARGS:-}" ] && common+=($EXTRA_SBATCH_ARGS)

GPU_GRES=${GPU_GRES-gpu}
gpus() { if [ -n "$GPU_GRES" ]; then echo "--gres=$GPU_GRES:$1"; fi; }  # used unquoted: empty -> no flag

submit() {  # submit NAME DEPENDENCY ARGS... -> prints the job id
  local name=$1 dep=$2; shift 2
  local dep_flag=()
  [ -n "$dep" ] && dep_flag=(--dependency "afterok:$dep" --kill-on-invalid-dep=yes)
  "$SBATCH" "${common[@]}" --job-name "$name" "${dep_flag[@]}" "$@" | cut -d';' -f1
}

jid=$(submit qerl-quantize "" $(gpus 1) --time "${TIME_QUANTIZE:-01:00:00}" "$SCRIPT" quantize "$CONFIG" "$RUN_DIR")
echo "quantize: $jid"
for ((s = 0; s < STEPS; s++)); do
  rid=$(submit "qerl-rollout-$s" "$jid" --array "0-$((SHARDS - 1))" $(gpus "${ROLLOUT_GPUS:-1}") \
    --time "${TIME_ROLLOUT:-04:00:00}" "$SCRIPT" rollout "$CONFIG" "$RUN_DIR" "$s")
  jid=$(submit "qerl-train-$s" "$rid" $(gpus "${TRAIN_GPUS:-1}") --time "${TIME_TRAIN:-02:00:00}" \
    "$SCRIPT" train "$CONFIG" "$RUN_DIR" "$s")
  echo "step $s: rollout $rid (array of $SHARDS) -> train $jid"
done
fid=$(submit qerl-final "$jid" $(gpus 1) --time "${TIME_QUANTIZE:-01:00:00}" "$SCRIPT" final "$CONFIG" "$RUN_DIR")
echo "final: $fid"
