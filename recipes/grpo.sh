#!/usr/bin/env bash
# The generic qerl RL loop: quantize -> STEPS x (rollout -> train-step) -> merge -> eval.
#
#   bash recipes/grpo.sh CONFIG.env [RUN_DIR]
#
# CONFIG.env is a sourced KEY=value file (see recipes/configs/). Every stage writes one
# step-numbered directory atomically and says "already done" when rerun with the same inputs,
# so rerunning this script after a crash resumes after the last completed stage; a changed
# config makes the first changed stage refuse (pass FORCE=1 to redo the stages that refuse).
# SIGTERM, SIGINT or SIGHUP to this script reach the running stage, which cleans up (a rollout keeps
# its finished groups); the script then exits with the stage's status, and a rerun resumes.
#
# Layout:  RUN_DIR/base/                       NVFP4 checkpoint (BASE_FORMAT=nvfp4)
#          RUN_DIR/step-000012/{shards,adapter,eval}
#          RUN_DIR/metrics.jsonl               one line per train-step
#          RUN_DIR/merged/, RUN_DIR/eval-final/
set -euo pipefail

CONFIG=${1:?usage: bash recipes/grpo.sh CONFIG.env [RUN_DIR]}
[ -f "$CONFIG" ] || { echo "error: config $CONFIG not found" >&2; exit 2; }
# shellcheck disable=SC1090
source "$CONFIG"
RUN_DIR=${2:-${RUN_DIR:-runs/$(basename "$CONFIG" .env)}}
QERL=${QERL:-qerl}
EVAL_EVERY=${EVAL_EVERY:-0}          # 0: evaluate only the base (step -1) and the final policy
EVAL_MAX_PROBLEMS=${EVAL_MAX_PROBLEMS:-0}
DTYPE=${DTYPE:-auto}
RUN_SEED=${RUN_SEED:-$SEED}
# The running stage gets the signal this script gets (bash would not pass it on to a foreground
# child: `kill <this pid>` left the stage running, still writing). The stage runs in its own process
# group, so a Ctrl-C or a signal to this script's group reaches it once, through here.
child=""
signals=0     # how many arrived (each ends a `wait` early)
signalled=""  # the number of the last one
on_signal() {  # SIGNAL NUMBER
  signals=$((signals + 1)); signalled=$2
  if [ -n "$child" ]; then
    kill -s "$1" "$child" 2>/dev/null || true
  else
    exit $((128 + $2))  # between stages: nothing to clean up
  fi
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT
trap 'on_signal TERM 1' HUP  # a closed terminal: the stage cleans up as after SIGTERM
run_qerl() {  # qerl ARGS..., as a child this script waits for; after a signal, exit with its status
  local rc seen
  set -m; "$QERL" "$@" < /dev/null & child=$!; set +m
  while :; do
    seen=$signals; rc=0; wait "$child" || rc=$?
    if [ "$signals" = "$seen" ]; then break; fi  # a signal ended this wait early: wait for the stage's status
  done
  child=""
  if [ -n "$signalled" ]; then exit $(( rc != 0 ? rc : 128 + signalled )); fi
  return "$rc"
}

# A stage that refuses because its output was made from other inputs exits 4. With FORCE=1 that
# stage alone is redone with --force; a later stage whose inputs it changed refuses and is redone in
# turn, and one whose inputs did not change stays "already done" (so changing MERGE_DTYPE redoes
# merge and eval, not the RL loop).
stage() {
  local rc=0
  run_qerl "$@" || rc=$?
  if [ "$rc" = 4 ] && [ "${FORCE:-0}" = 1 ]; then
    echo "FORCE=1: qerl $1 refused above (exit 4, made from other inputs); redoing it with --force" >&2
    run_qerl "$@" --force
  else
    return "$rc"
  fi
}

for v in MODEL DATASET STEPS PROMPTS_PER_STEP NUM_GENERATIONS MAX_NEW_TOKENS LR LORA_RANK LORA_ALPHA; do
  [ -n "${!v:-}" ] || { echo "error: $CONFIG does not set $v" >&2; exit 2; }
done
mkdir -p "$RUN_DIR"
step_dir() { printf '%s/step-%06d' "$RUN_DIR" "$1"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

reward_flags=()
for r in $REWARDS; do reward_flags+=(--reward "$r"); done
# The same instruction around every prompt for rollout and eval (empty: the rows' prompts as they are).
template_flag=()
[ -n "${PROMPT_TEMPLATE:-}" ] && template_flag=(--prompt-template "$PROMPT_TEMPLATE")
# A Jinja chat template for a tokenizer without one (a base model's), for `messages` rows.
[ -n "${CHAT_TEMPLATE_FILE:-}" ] && template_flag+=(--chat-template-file "$CHAT_TEMPLATE_FILE")
eval_flags=(--dataset "${EVAL_DATASET:-$DATASET}" --max-new-tokens "$MAX_NEW_TOKENS" --device "$DEVICE" --dtype "$DTYPE" "${template_flag[@]}")
[ "$EVAL_MAX_PROBLEMS" != 0 ] && eval_flags+=(--max-problems "$EVAL_MAX_PROBLEMS")

# 1. The frozen base: NVFP4 (QeRL) or the bf16 checkpoint itself (16-bit LoRA baseline).
if [ "${BASE_FORMAT:-nvfp4}" = nvfp4 ]; then
  say "quantize $MODEL"
  stage quantize "$MODEL" --out "$RUN_DIR/base" --device "$DEVICE"
  BASE=$RUN_DIR/base
else
  BASE=$MODEL
fi

if [ -n "${EVAL_DATASET:-}" ]; then
  say "eval base policy"
  stage eval --model "$BASE" "${eval_flags[@]}" --out "$RUN_DIR/eval-base"
fi

# 2. The RL loop. Step s samples with adapter s-1 and writes adapter s.
adapter_flag=()
read -r -a train_extra <<< "${TRAIN_EXTRA:-}"  # extra train-step flags from the config, word-split
for ((s = 0; s < STEPS; s++)); do
  d=$(step_dir "$s")
  say "step $s / $STEPS: rollout"
  stage rollout --model "$BASE" "${adapter_flag[@]}" --prompts "$DATASET" --out "$d/shards" \
    --step "$s" --prompts-per-step "$PROMPTS_PER_STEP" --num-generations "$NUM_GENERATIONS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --top-p "$TOP_P" "${reward_flags[@]}" "${template_flag[@]}" \
    --aqn-sigma-start "${AQN_SIGMA_START:-0}" --aqn-sigma-end "${AQN_SIGMA_END:-0}" \
    --aqn-stages "${AQN_STAGES:-10}" --total-steps "$STEPS" --run-seed "$RUN_SEED" --seed "$SEED" \
    --device "$DEVICE" --dtype "$DTYPE"
  say "step $s / $STEPS: train-step"
  stage train-step --model "$BASE" "${adapter_flag[@]}" --shards "$d/shards" --out "$d/adapter" \
    --loss "$LOSS" --clip-eps "$CLIP_EPS" --clip-eps-high "$CLIP_EPS_HIGH" --beta "$BETA" --tis-cap "$TIS_CAP" \
    --lr "$LR" --warmup-steps "$WARMUP_STEPS" --total-steps "$STEPS" --max-grad-norm "$MAX_GRAD_NORM" \
    --lora-rank "$LORA_RANK" --lora-alpha "$LORA_ALPHA" --micro-batch-tokens "$MICRO_BATCH_TOKENS" \
    --seed "$SEED" --device "$DEVICE" --dtype "$DTYPE" --metrics-file "$RUN_DIR/metrics.jsonl" \
    "${train_extra[@]}"
  adapter_flag=(--adapter "$d/adapter")
  if [ -n "${EVAL_DATASET:-}" ] && [ "$EVAL_EVERY" -gt 0 ] && (( (s + 1) % EVAL_EVERY == 0 )) && (( s + 1 < STEPS )); then
    say "step $s: eval"
    stage eval --model "$BASE" "${adapter_flag[@]}" "${eval_flags[@]}" --out "$d/eval"
  fi
done

# 3. A servable checkpoint and its score.
last=$(step_dir $((STEPS - 1)))
say "merge"
merge_flags=(--dtype "${MERGE_DTYPE:-bf16}")
# An FP4 merge keeps a small RL update only when it is added to the bf16 source (docs/merge-eval.md).
[ "${MERGE_DTYPE:-bf16}" = nvfp4 ] && [ "$BASE" != "$MODEL" ] && merge_flags+=(--requantize-from "$MODEL")
stage merge --model "$BASE" --adapter "$last/adapter" --out "$RUN_DIR/merged" "${merge_flags[@]}"
if [ -n "${EVAL_DATASET:-}" ]; then
  say "eval merged policy"
  stage eval --model "$RUN_DIR/merged" "${eval_flags[@]}" --out "$RUN_DIR/eval-final"
  run_qerl eval --compare "$RUN_DIR/eval-base" "$RUN_DIR/eval-final"
fi
