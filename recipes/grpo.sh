#!/usr/bin/env bash
# The generic qerl RL loop: quantize -> STEPS x (rollout -> train-step) -> merge -> eval.
#
#   bash recipes/grpo.sh CONFIG.env [RUN_DIR]
#   STEPS=0 bash recipes/grpo.sh CONFIG.env [RUN_DIR]     the base only: quantize it, score it
#
# CONFIG.env is a sourced KEY=value file (see recipes/configs/). Every stage writes one
# step-numbered directory atomically and says "already done" when rerun with the same inputs,
# so rerunning this script after a crash resumes after the last completed stage; a changed
# config makes the first changed stage refuse (pass FORCE=1 to redo the stages that refuse).
# The stages' command lines come from recipes/lib.sh, shared with the Slurm chain (recipes/slurm/).
# SIGTERM, SIGINT, SIGHUP or SIGQUIT to this script reach the running stage, which cleans up (a rollout keeps
# its finished groups); the script then exits with the stage's status (as killed by the signal when the
# stage stopped with the signal's status), and a rerun resumes. If the script dies (kill -9), the stage gets
# SIGTERM; Ctrl-Z stops the stage with it.
#
# Layout:  RUN_DIR/base/                       NVFP4 checkpoint (BASE_FORMAT=nvfp4)
#          RUN_DIR/step-000012/{shards,adapter,eval}   (a Slurm chain's one-task step: shards-0, kept)
#          RUN_DIR/metrics.jsonl               one line per train-step
#          RUN_DIR/shuffle                     SHUFFLE as the run dir's first rollout was begun (1 or 0)
#          RUN_DIR/merged/, RUN_DIR/eval-final/
set -euo pipefail

# shellcheck source=recipes/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
qerl_help_if_asked "${BASH_SOURCE[0]}" "${1:-}"
CONFIG=${1:?usage: bash recipes/grpo.sh CONFIG.env [RUN_DIR]}
case "$CONFIG" in -*) CONFIG=./$CONFIG ;; esac  # a CONFIG "-x.env" (not -h): source and basename read an option
[ -f "$CONFIG" ] || { echo "error: config $CONFIG not found" >&2; exit 2; }
qerl_check_env_numbers
# shellcheck disable=SC1090
source "$CONFIG"
qerl_load_config "$CONFIG"
qerl_set_base "${2:-${RUN_DIR:-runs/$(basename "$CONFIG" .env)}}"
QERL=${QERL:-qerl}
qerl_read_qerl  # a wrapper may come first: QERL="apptainer exec img.sif qerl"

# The running stage gets the signal this script gets, and the script ends once the stage has (qerl_run_forwarding).
run_qerl() {  # qerl ARGS...
  # QERL_STOP_WITH_PARENT: the stage gets SIGTERM if its parent dies (a SIGKILL of this script's group reaches
  # nothing in the stage's own group otherwise; qerl_cli.cli._stop_with_parent). qerl_run_forwarding sets that
  # for the command it starts too, where setpriv or python3 is there; the stage's own covers a QERL wrapper
  # (its parent) and a host with neither.
  # qerl_run_recording: QERL_FAILED says why it failed (the notes below)
  QERL_STOP_WITH_PARENT=1 qerl_run_recording qerl_run_forwarding "${QERL_WORDS[@]}" "$@"
}

# A stage that refuses its output exits 4: made from other inputs, damaged, or (eval) begun on another GPU model, a run
# stopped there or a finished one to be scored again with problems generated anew, which this one would finish with
# other numerics. With FORCE=1 that
# stage alone is redone with --force; a later stage whose inputs it changed refuses and is redone in
# turn, and one whose inputs did not change stays "already done" (so changing MERGE_DTYPE redoes
# merge and eval, not the RL loop). Exit 8 (another qerl run is writing that output, or wrote it meanwhile: two
# loops on one run dir) is never redone: --force would replace the other loop's output.
stage() {
  local rc=0
  run_qerl "$@" || rc=$?
  if [ "$rc" = 4 ] && [ "${FORCE:-0}" = 1 ]; then
    # the reason is the stage's line above ("made from other inputs" named every refusal, a GPU model's too)
    echo "FORCE=1: qerl $1 refused above (exit 4); redoing it with --force" >&2
    run_qerl "$@" --force
  else
    # The stage's own hint says "pass --force", a flag this script takes as FORCE=1 (a user looked for a way to pass it).
    if [ "$rc" = 4 ]; then
      echo "note: qerl $1 refused (exit 4): FORCE=1 reruns this script redoing each stage that refuses; a changed STEPS" \
        "cannot extend a run (start a new RUN_DIR)" >&2
      # its other way out, which FORCE=1 would throw away: the problems generated there. Not only a stopped eval: a
      # finished one that today's rules score again with problems generated anew is refused so too (qerl_cli/evaluate.py).
      # Only after that refusal (OtherGpuModelError, as the stage recorded it): it followed any eval's exit 4, "made from
      # other inputs" too (a review, session 59)
      if [ "$1" = eval ] && qerl_failed_with 4 OtherGpuModelError; then
        echo "note: an eval begun on another GPU model, stopped there or to be scored again with problems generated" \
          "anew (the line above says which), goes on only on a GPU of that model; FORCE=1 generates it all afresh here" >&2
      fi
    fi
    return "$rc"
  fi
}

mkdir -p "$RUN_DIR"
# A run dir a Slurm chain of several rollout tasks began is refused before any stage (qerl_shard_dirs).
for ((s = 0; s < STEPS; s++)); do qerl_shard_dirs "$s" 1 shards; done
# Every rollout reshuffles the prompts each epoch, or none does: SHUFFLE, as the run dir's rollouts were begun.
if [ "$STEPS" -gt 0 ]; then qerl_resolve_shuffle; fi
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# 1. The frozen base: NVFP4 (QeRL) or the bf16 checkpoint itself (16-bit LoRA baseline).
if [ "$BASE_FORMAT" = nvfp4 ]; then
  say "quantize $MODEL"
  qerl_quantize_cmd; stage "${QERL_CMD[@]}"
fi

if [ -n "$EVAL_DATASET" ]; then
  say "eval base policy"
  qerl_eval_cmd -1; stage "${QERL_CMD[@]}"
fi

# STEPS=0: the base alone (compare_aqn.sh makes the base its runs share this way).
if [ "$STEPS" -eq 0 ]; then
  say "STEPS=0: the base policy only; no RL steps, nothing to merge"
  exit 0
fi

# 2. The RL loop. Step s samples with adapter s-1 and writes adapter s.
# A rerun goes through the steps before the last finished one without starting qerl for each (a stage that
# says "already done" costs a process start, ~2 s: 35 minutes for a 500-step run; a review, 2026-11-27), where
# their adapters are one run's (qerl_resume_point). That step's stages check the current config and inputs
# first; if one refuses, every step is gone through from step 0, as without the shortcut, so the first stage
# whose inputs changed is the one that says so (and FORCE=1, which takes no shortcut, redoes from there).
qerl_resume_point; first=$QERL_FIRST
if [ "$first" -gt 0 ]; then
  qerl_shard_dirs "$first" 1 shards; d=${QERL_SHARD_DIRS[0]}
  say "step $first / $STEPS: the last finished step, checked against this config"
  qerl_rollout_cmd "$first" "$d"
  if ! run_qerl "${QERL_CMD[@]}" || { qerl_train_cmd "$first" --shards "$d"; ! run_qerl "${QERL_CMD[@]}"; }; then
    say "step $first refused (above): going through every step from step 0"
    first=0
  else
    first=$((first + 1))  # its two stages just said "already done": the loop starts after it
  fi
fi
if [ "$first" -gt 0 ]; then
  say "steps 0-$((first - 1)) / $STEPS: finished"
  for ((s = 0; s < first; s++)); do
    if qerl_eval_missing "$s"; then
      say "step $s: eval"
      qerl_eval_cmd "$s"; stage "${QERL_CMD[@]}"
    fi
  done
fi
for ((s = first; s < STEPS; s++)); do
  qerl_shard_dirs "$s" 1 shards; d=${QERL_SHARD_DIRS[0]}  # step-<s>/shards, or a chain's step-<s>/shards-0
  say "step $s / $STEPS: rollout"
  qerl_rollout_cmd "$s" "$d"; stage "${QERL_CMD[@]}"
  say "step $s / $STEPS: train-step"
  qerl_train_cmd "$s" --shards "$d"; stage "${QERL_CMD[@]}"
  if qerl_eval_due "$s"; then
    say "step $s: eval"
    qerl_eval_cmd "$s"; stage "${QERL_CMD[@]}"
  fi
done

# 3. A servable checkpoint and its score.
say "merge"
qerl_merge_cmd; stage "${QERL_CMD[@]}"
if [ -n "$EVAL_DATASET" ]; then
  say "eval merged policy"
  qerl_eval_cmd final; stage "${QERL_CMD[@]}"
  qerl_compare_cmd; run_qerl "${QERL_CMD[@]}"
fi
# A FORCE=1 rerun with fewer STEPS redid steps 0..STEPS-1 and left the earlier run's later steps: say so, delete nothing.
mapfile -t later < <(qerl_steps_past_the_end)
if [ "${#later[@]}" -gt 0 ]; then
  echo "note: $RUN_DIR keeps ${later[0]}${later[1]:+ .. ${later[-1]}} (at or past STEPS=$STEPS) from an earlier," \
    "longer run: not this run's steps (recipes/plot_run.py leaves them out); delete or move them to free their space" >&2
fi
