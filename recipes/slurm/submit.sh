#!/usr/bin/env bash
# Submit a whole qerl RL run to Slurm as a chain of dependent jobs:
#   quantize -> [rollout array (ROLLOUT_SHARDS tasks) -> train] x STEPS -> final (merge + eval)
# and, with EVAL_DATASET, beside the chain: the base policy's eval (after quantize; final waits for it)
# and one eval every EVAL_EVERY steps (after that step's train; nothing waits for them).
#
#   bash recipes/slurm/submit.sh CONFIG.env [RUN_DIR]
#
# Every stage is idempotent, so after a failure (which cancels the jobs that depend on the failed one)
# resubmit the whole chain: it redoes only what is missing. RUN_DIR/submit.env keeps every value the
# stages read, as resolved at submission (from CONFIG or the environment), and every job reads it after
# CONFIG, so a job rerun alone sees the chain's values; edit it to change one for such a rerun.
# Variables (environment or CONFIG): PARTITION, ACCOUNT, ROLLOUT_SHARDS (default 1; one GPU per task),
# TRAIN_GPUS (1; >1 runs torchrun), GPU_GRES (gres name, default gpu; empty: no --gres, e.g. a
# CPU-only test cluster), TIME_ROLLOUT, TIME_TRAIN, TIME_QUANTIZE, TIME_EVAL, JOB_CPUS (--cpus-per-task) and
# JOB_MEM (--mem) for every job, EXTRA_SBATCH_ARGS.
# SBATCH=echo-like command replaces sbatch for a dry run (it must print a job id).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECIPES=$(cd "$HERE/.." && pwd)
# shellcheck source=recipes/lib.sh
source "$RECIPES/lib.sh"
qerl_help_if_asked "$HERE/submit.sh" "${1:-}"
CONFIG=${1:?usage: bash recipes/slurm/submit.sh CONFIG.env [RUN_DIR]}
case "$CONFIG" in -*) CONFIG=./$CONFIG ;; esac  # a CONFIG "-x.env" (not -h): source and basename read an option
[ -f "$CONFIG" ] || { echo "error: config $CONFIG not found" >&2; exit 2; }
qerl_check_env_numbers
# shellcheck disable=SC1090
source "$CONFIG"
qerl_load_config "$CONFIG"
if [ "$STEPS" -eq 0 ]; then  # grpo.sh's base-only run; a chain needs a step
  echo "error: STEPS=0: nothing to chain (for the base alone: STEPS=0 bash recipes/grpo.sh $CONFIG)" >&2
  exit 2
fi
# A rollout runs on one GPU (no tensor parallelism): more per task sat idle.
if [ "${ROLLOUT_GPUS:-1}" != 1 ]; then
  echo "error: ROLLOUT_GPUS=$ROLLOUT_GPUS: a rollout task uses one GPU; raise ROLLOUT_SHARDS for more rollout GPUs" >&2
  exit 2
fi
RUN_DIR=${2:-${RUN_DIR:-runs/$(basename "$CONFIG" .env)}}
CONFIG=$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")
mkdir -p -- "$RUN_DIR"; RUN_DIR=$(cd -- "$RUN_DIR" && pwd)
# A step of another shard count (grpo.sh's one with ROLLOUT_SHARDS > 1, a chain's of another ROLLOUT_SHARDS) is
# refused before a job is queued (qerl_shard_dirs): its first rollout task would fail (with FORCE=1, delete a shard).
# With one task the chain continues grpo.sh's steps in step-<s>/shards.
for ((s = 0; s < STEPS; s++)); do qerl_shard_dirs "$s" "$ROLLOUT_SHARDS" shards-; done
qerl_resolve_shuffle  # SHUFFLE=auto: 1 or 0 as the run dir's rollouts were begun, recorded so in submit.env
SBATCH=${SBATCH:-sbatch}
SCRIPT=$HERE/stage.sbatch
# Every value the stages read, resolved now (the config's ${VAR:-default} and what only the environment
# set, e.g. RUN_SEED or DTYPE): a job rerun alone later (an array task, a train job) must see the same
# ones, or it reads 1 of N shards, or samples other prompts with another G into the same step.
# stage.sbatch sources this file after CONFIG.
{
  echo "# written by submit.sh $(date -u +%FT%TZ): the chain's settings, read by every job after CONFIG."
  echo "# To change one for a job you rerun alone, edit it here; resubmitting the chain rewrites this file."
  printf 'QERL_RECIPES_DIR=%q\n' "$RECIPES"
  for v in "${QERL_STAGE_VARS[@]}"; do qerl_setting_line "$v"; done
  # 1: a job whose stage refuses (exit 4: made from other inputs, or an eval another GPU model began, stopped or to
  # be scored again) redoes it with --force
  printf 'FORCE=%q\n' "${FORCE:-0}"
} > "$RUN_DIR/submit.env"

common=(--parsable --chdir "$PWD")
[ -n "${PARTITION:-}" ] && common+=(--partition "$PARTITION")
[ -n "${ACCOUNT:-}" ] && common+=(--account "$ACCOUNT")
# Clusters whose default is one core and a little memory per job starve a stage (tokenizing, loading and
# hashing a 7B checkpoint): JOB_CPUS and JOB_MEM set them for every job. (Not SLURM_*: Slurm sets those
# inside an allocation, where submit.sh may run.)
[ -n "${JOB_CPUS:-}" ] && common+=(--cpus-per-task "$JOB_CPUS")
[ -n "${JOB_MEM:-}" ] && common+=(--mem "$JOB_MEM")
# shellcheck disable=SC2206
[ -n "${EXTRA_SBATCH_ARGS:-}" ] && common+=($EXTRA_SBATCH_ARGS)
log_job=(--output "$RUN_DIR/slurm-%x-%j.out")      # %a is 4294967294 outside an array
log_task=(--output "$RUN_DIR/slurm-%x-%A_%a.out")   # array job id _ task index

GPU_GRES=${GPU_GRES-gpu}
gpus=()
if [ -n "$GPU_GRES" ]; then gpus=(--gres="$GPU_GRES:1"); fi
train_gpus=()
if [ -n "$GPU_GRES" ]; then train_gpus=(--gres="$GPU_GRES:$TRAIN_GPUS"); fi

SUBMITTED=()  # every job id this run submitted: cancelled if a later sbatch fails
qid="" bid="" rid="" jid="" eid="" fid=""  # set by submit
submit() {  # submit VAR NAME DEPENDENCY ARGS... -> VAR holds the job id (DEPENDENCY: id[:id...] or empty)
  local var=$1 name=$2 dep=$3 out; shift 3
  local dep_flag=()
  [ -n "$dep" ] && dep_flag=(--dependency "afterok:$dep" --kill-on-invalid-dep=yes)
  if ! out=$("$SBATCH" "${common[@]}" --job-name "$name" "${dep_flag[@]}" "$@"); then abort_chain "$name"; fi
  printf -v "$var" '%s' "${out%%;*}"
  SUBMITTED+=("${!var}")
}

# A half-submitted chain (sbatch refused one job: a QOS limit on jobs per user, a wrong partition) left the jobs
# before it queued, a rerun submitting them all again beside them (a review, 2026-11-27): cancel them.
abort_chain() {  # abort_chain NAME
  echo "error: sbatch refused job $1; cancelling the ${#SUBMITTED[@]} job(s) this chain submitted before it" >&2
  if [ "${#SUBMITTED[@]}" -gt 0 ] && ! "${SCANCEL:-scancel}" "${SUBMITTED[@]}"; then
    echo "error: scancel failed too: cancel them yourself: scancel ${SUBMITTED[*]}" >&2
  fi
  exit 1
}

submit qid qerl-quantize "" "${log_job[@]}" "${gpus[@]}" --time "${TIME_QUANTIZE:-01:00:00}" \
  "$SCRIPT" quantize "$CONFIG" "$RUN_DIR"
echo "quantize: $qid"
final_dep=""
if [ -n "$EVAL_DATASET" ]; then  # the base policy's score, off the critical path
  submit bid qerl-eval-base "$qid" "${log_job[@]}" "${gpus[@]}" --time "${TIME_EVAL:-01:00:00}" \
    "$SCRIPT" eval "$CONFIG" "$RUN_DIR" -1
  echo "eval base: $bid"
  final_dep=":$bid"
fi
jid=$qid
# A resubmitted chain starts at the last step with a finished adapter where every adapter before it is of the same
# run (qerl_resume_point), as grpo.sh's rerun does: each earlier step took two GPU jobs only to say "already done"
# (a review, 2026-11-27). That step's jobs check the current config and inputs; an eval missing before it is
# submitted. A refusal there cancels the chain (afterok); with FORCE=1 the chain starts at step 0 and each job
# redoes a stage that refuses (exit 4: made from other inputs, or an eval another GPU model began, stopped or to be
# scored again, which starts afresh) with --force, as grpo.sh does.
qerl_resume_point; first=$QERL_FIRST
if [ "$first" -gt 0 ]; then
  echo "steps 0-$((first - 1)): finished; the chain starts at step $first"
  for ((s = 0; s < first; s++)); do
    if qerl_eval_missing "$s"; then
      submit eid "qerl-eval-$s" "$qid" "${log_job[@]}" "${gpus[@]}" --time "${TIME_EVAL:-01:00:00}" \
        "$SCRIPT" eval "$CONFIG" "$RUN_DIR" "$s"
      echo "step $s: eval $eid"
    fi
  done
fi
for ((s = first; s < STEPS; s++)); do
  submit rid "qerl-rollout-$s" "$jid" --array "0-$((ROLLOUT_SHARDS - 1))" "${log_task[@]}" "${gpus[@]}" \
    --time "${TIME_ROLLOUT:-04:00:00}" "$SCRIPT" rollout "$CONFIG" "$RUN_DIR" "$s"
  submit jid "qerl-train-$s" "$rid" "${log_job[@]}" "${train_gpus[@]}" --time "${TIME_TRAIN:-02:00:00}" \
    "$SCRIPT" train "$CONFIG" "$RUN_DIR" "$s"
  echo "step $s: rollout $rid (array of $ROLLOUT_SHARDS) -> train $jid"
  if qerl_eval_due "$s"; then  # beside the chain: nothing depends on it
    submit eid "qerl-eval-$s" "$jid" "${log_job[@]}" "${gpus[@]}" --time "${TIME_EVAL:-01:00:00}" \
      "$SCRIPT" eval "$CONFIG" "$RUN_DIR" "$s"
    echo "step $s: eval $eid"
  fi
done
submit fid qerl-final "$jid$final_dep" "${log_job[@]}" "${gpus[@]}" --time "${TIME_QUANTIZE:-01:00:00}" \
  "$SCRIPT" final "$CONFIG" "$RUN_DIR"
echo "final: $fid"
