# The pieces recipes/grpo.sh and recipes/slurm/stage.sbatch share; sourced by them and by
# recipes/slurm/submit.sh, after CONFIG. One place for the config check and for every stage's
# command line built from the config, so a flag added here reaches the local loop and the Slurm
# chain alike (they once kept a copy each, and stage.sbatch lost --chat-template-file).
#
#   source CONFIG; source recipes/lib.sh; qerl_load_config CONFIG; qerl_set_base RUN_DIR
#   qerl_resolve_shuffle                                              (before the first qerl_rollout_cmd)
#   qerl_rollout_cmd STEP OUT [FLAG...]; "$QERL" "${QERL_CMD[@]}"     (and the other *_cmd)
# shellcheck shell=bash

# Every variable the stages read: these the config (or the environment) must set, non-empty ...
QERL_REQUIRED_VARS=(MODEL DATASET STEPS PROMPTS_PER_STEP NUM_GENERATIONS MAX_NEW_TOKENS TEMPERATURE TOP_P
  REWARDS LOSS CLIP_EPS CLIP_EPS_HIGH BETA TIS_CAP LR WARMUP_STEPS MAX_GRAD_NORM LORA_RANK LORA_ALPHA
  MICRO_BATCH_TOKENS SEED DEVICE)
# ... and these have a default (qerl_load_config). ROLLOUT_SHARDS and TRAIN_GPUS are read by the Slurm jobs.
QERL_OPTIONAL_VARS=(EVAL_DATASET EVAL_MAX_PROBLEMS EVAL_EVERY BASE_FORMAT MERGE_DTYPE DTYPE RUN_SEED
  PROMPT_TEMPLATE CHAT_TEMPLATE_FILE CHAT_TEMPLATE_KWARGS PROMPT_KEY ANSWER_KEY EVAL_PROMPT_KEY EVAL_ANSWER_KEY
  SYSTEM_PROMPT STOP TRAIN_EXTRA AQN_SIGMA_START AQN_SIGMA_END AQN_STAGES ROLLOUT_SHARDS TRAIN_GPUS
  SHUFFLE)
# shellcheck disable=SC2034
QERL_STAGE_VARS=("${QERL_REQUIRED_VARS[@]}" "${QERL_OPTIONAL_VARS[@]}")

_qerl_die() { echo "error: $*" >&2; exit 2; }

# One setting as a line bash reads back (submit.sh's submit.env): VAR=value, or VAR=(value ...) where the config made
# it an array (STOP: several stop strings), every element kept: `%q` of $STOP wrote the first alone.
qerl_setting_line() {  # VAR
  local all="$1[@]" x
  if _qerl_is_array "$1"; then
    printf '%s=(' "$1"
    for x in "${!all}"; do printf ' %q' "$x"; done
    printf ' )\n'
  else
    printf '%s=%q\n' "$1" "${!1}"
  fi
}
_qerl_is_array() { [[ $(declare -p "$1" 2> /dev/null) =~ ^declare\ -[a-zA-Z]*a ]]; }  # VAR

# The whole-number keys. The configs compute with some of them (WARMUP_STEPS from STEPS) as they are
# sourced, before qerl_load_config can check them, so STEPS=abc from the environment ended in bash's
# "abc: unbound variable": grpo.sh and submit.sh call qerl_check_env_numbers before sourcing CONFIG.
QERL_NUMBER_VARS=(STEPS EVAL_EVERY EVAL_MAX_PROBLEMS ROLLOUT_SHARDS TRAIN_GPUS)
# No leading zeros: bash reads 010 as octal 8 (and 08 not at all), the stages as 10.
QERL_WHOLE_NUMBER='^(0|[1-9][0-9]*)$'
qerl_check_env_numbers() {
  local v
  for v in "${QERL_NUMBER_VARS[@]}"; do
    if [ -n "${!v:-}" ] && ! [[ ${!v} =~ $QERL_WHOLE_NUMBER ]]; then _qerl_die "$v=${!v}: expected a whole number"; fi
  done
}

# Check the sourced config, then give every optional variable its value; exit 2 naming what is wrong.
qerl_load_config() {  # CONFIG (for the messages)
  local v missing=()
  for v in "${QERL_REQUIRED_VARS[@]}"; do
    [ -n "${!v:-}" ] || missing+=("$v")
  done
  [ "${#missing[@]}" = 0 ] || _qerl_die "$1 does not set ${missing[*]} (every stage reads them; see recipes/configs/*.env)"
  EVAL_DATASET=${EVAL_DATASET:-}
  EVAL_MAX_PROBLEMS=${EVAL_MAX_PROBLEMS:-0}
  EVAL_EVERY=${EVAL_EVERY:-0}          # 0: evaluate only the base (step -1) and the final policy
  BASE_FORMAT=${BASE_FORMAT:-nvfp4}
  MERGE_DTYPE=${MERGE_DTYPE:-bf16}
  DTYPE=${DTYPE:-auto}
  RUN_SEED=${RUN_SEED:-$SEED}
  PROMPT_TEMPLATE=${PROMPT_TEMPLATE:-}
  CHAT_TEMPLATE_FILE=${CHAT_TEMPLATE_FILE:-}
  CHAT_TEMPLATE_KWARGS=${CHAT_TEMPLATE_KWARGS:-}  # a JSON object, e.g. '{"enable_thinking": false}' (Qwen3)
  PROMPT_KEY=${PROMPT_KEY:-}           # DATASET's own column names (rollout --prompt-key / --answer-key) ...
  ANSWER_KEY=${ANSWER_KEY:-}
  # ... and EVAL_DATASET's (eval's), the same unless set: a set of one's own to train on beside a standard test set
  # named the train set's columns to eval, which refused every row of it ("row has no `question`"; session 59's list).
  # Set empty: eval's own columns (no flag), which `:-` made the train set's again once PROMPT_KEY was set.
  EVAL_PROMPT_KEY=${EVAL_PROMPT_KEY-$PROMPT_KEY}
  EVAL_ANSWER_KEY=${EVAL_ANSWER_KEY-$ANSWER_KEY}
  SYSTEM_PROMPT=${SYSTEM_PROMPT:-}     # rollout and eval --system-prompt (with a chat template)
  # rollout and eval --stop, e.g. STOP=$'\nQ:' (a base model's few-shot); several as a bash array in the config:
  # STOP=($'\nQ:' '</answer>') (_qerl_template_flags; the environment holds one string)
  STOP=${STOP:-}
  TRAIN_EXTRA=${TRAIN_EXTRA:-}
  AQN_SIGMA_START=${AQN_SIGMA_START:-0}
  AQN_SIGMA_END=${AQN_SIGMA_END:-0}
  AQN_STAGES=${AQN_STAGES:-10}
  ROLLOUT_SHARDS=${ROLLOUT_SHARDS:-1}
  TRAIN_GPUS=${TRAIN_GPUS:-1}
  SHUFFLE=${SHUFFLE:-auto}             # qerl_resolve_shuffle
  # Anything else once ran the 16-bit baseline without a word (BASE_FORMAT=NVFP4 included).
  case "$BASE_FORMAT" in nvfp4 | bf16) ;; *) _qerl_die "BASE_FORMAT=$BASE_FORMAT: use nvfp4 (QeRL) or bf16 (the 16-bit LoRA baseline)" ;; esac
  case "$MERGE_DTYPE" in nvfp4 | bf16) ;; *) _qerl_die "MERGE_DTYPE=$MERGE_DTYPE: use bf16 or nvfp4" ;; esac
  case "$SHUFFLE" in auto | 1 | 0) ;; *) _qerl_die "SHUFFLE=$SHUFFLE: use auto, 1 (reshuffle the prompts each epoch) or 0 (file order)" ;; esac
  for v in "${QERL_NUMBER_VARS[@]}"; do
    [[ ${!v} =~ $QERL_WHOLE_NUMBER ]] || _qerl_die "$v=${!v}: expected a whole number"
  done
  for v in ROLLOUT_SHARDS TRAIN_GPUS; do
    [ "${!v}" -ge 1 ] || _qerl_die "$v=${!v}: expected at least 1"
  done  # STEPS=0 is grpo.sh's base-only run (quantize, score the base); submit.sh refuses it
  qerl_check_stage_values "$1"
}

# The stage flags' values, checked here because each stage checks its own only when it runs: LR=abc stopped the
# loop after quantize and a whole rollout, and on Slurm after the chain was queued (a review, 2026-11-27).
# Only what is certain: the stages keep the finer rules (top-p in (0, 1], a temperature's floor, ...).
QERL_STAGE_COUNTS=(PROMPTS_PER_STEP NUM_GENERATIONS MAX_NEW_TOKENS LORA_RANK MICRO_BATCH_TOKENS WARMUP_STEPS AQN_STAGES)
QERL_STAGE_FLOATS=(TEMPERATURE TOP_P CLIP_EPS CLIP_EPS_HIGH BETA TIS_CAP LR MAX_GRAD_NORM LORA_ALPHA AQN_SIGMA_START
  AQN_SIGMA_END)
QERL_FLOAT='^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$'
qerl_check_stage_values() {  # CONFIG (for the messages)
  local v
  for v in "${QERL_STAGE_COUNTS[@]}"; do
    [[ ${!v} =~ $QERL_WHOLE_NUMBER ]] || _qerl_die "$v=${!v}: expected a whole number ($1)"
  done
  for v in PROMPTS_PER_STEP MAX_NEW_TOKENS LORA_RANK MICRO_BATCH_TOKENS; do  # AQN_STAGES=0: only with AQN off (below)
    [ "${!v}" -ge 1 ] || _qerl_die "$v=${!v}: expected at least 1 ($1)"
  done
  [ "$NUM_GENERATIONS" -ge 2 ] || _qerl_die "NUM_GENERATIONS=$NUM_GENERATIONS: a group needs at least 2 completions for its advantages ($1)"
  if [ "$STEPS" -ge 1 ] && [ "$WARMUP_STEPS" -ge "$STEPS" ]; then
    _qerl_die "WARMUP_STEPS=$WARMUP_STEPS: must be below STEPS=$STEPS, the run's total ($1)"
  fi
  for v in "${QERL_STAGE_FLOATS[@]}"; do
    [[ ${!v} =~ $QERL_FLOAT ]] || _qerl_die "$v=${!v}: expected a number >= 0, e.g. 1e-5 or 0.2 ($1)"
  done
  # Zeros no stage runs with, found by train-step (LORA_ALPHA=0: after quantize and a whole rollout) or the first
  # rollout (AQN on with no stage, or a geometric schedule down to 0).
  if [[ $LORA_ALPHA =~ $QERL_ZERO ]]; then _qerl_die "LORA_ALPHA=$LORA_ALPHA: expected a number > 0 ($1)"; fi
  if ! [[ $AQN_SIGMA_START =~ $QERL_ZERO ]]; then
    if [ "$AQN_STAGES" -lt 1 ]; then
      _qerl_die "AQN_STAGES=$AQN_STAGES: AQN is on (AQN_SIGMA_START=$AQN_SIGMA_START) and needs at least 1 stage; AQN_SIGMA_START=0 turns it off ($1)"
    fi
    if [ "$AQN_STAGES" -gt 1 ] && [[ $AQN_SIGMA_END =~ $QERL_ZERO ]]; then
      _qerl_die "AQN_SIGMA_END=$AQN_SIGMA_END: must be > 0 when AQN_SIGMA_START > 0 (the schedule is geometric), e.g. 1e-4 ($1)"
    fi
  fi
}
QERL_ZERO='^[0.]*([eE][-+]?[0-9]+)?$'  # a QERL_FLOAT that is 0


# -h or --help as a script's first argument prints the script's header comment and exits 0: grpo.sh and submit.sh
# said "error: config --help not found", quickstart.sh and compare_aqn.sh started a run in a directory "--help".
# Not stage.sbatch's #SBATCH lines: options for sbatch, not words for the reader.
qerl_help_if_asked() {  # SCRIPT FIRST_ARG
  case ${2:-} in
    -h | --help) sed -n '2,/^[^#]/{/^#SBATCH/d;/^#/s/^# \{0,1\}//p;}' "$1"; exit 0 ;;
  esac
}

qerl_step_dir() { printf '%s/step-%06d' "$RUN_DIR" "$1"; }

# The rollout directories of step S: grpo.sh writes one, step-S/shards; a Slurm chain one a rollout task,
# step-S/shards-<i>. One task's shard is the same rollout as grpo.sh's (shard 0 of 1: the same fingerprint), so a
# step of one shard keeps the name it has on disk (a rollout under way: its .NAME.partial-* directory). A run dir
# moved between the two redid each begun step's rollout under the other name (hours of GPU for a large model), and
# grpo.sh on a chain's step of several shards then refused with "input shards changed" after that rollout, where
# FORCE=1 would have redone the run from step 0 (a review, 2026-11-27). A step split into another number of shards
# than the caller's (grpo.sh and a one-task chain: 1; a chain: ROLLOUT_SHARDS) is refused, naming what continues it,
# where the step has no rollout of the caller's count: a step both scripts rolled out (each did so before
# 2026-11-27) was refused by each, naming the other; the caller goes on with its own, and its train-step says if the
# adapter is the other's. A chain of another count than the step's once got as far as its first rollout task (exit 4,
# "holds shard 0 of 2"; with FORCE=1 it deleted that shard), or its train job (a review, session 55).
qerl_shard_dirs() {  # STEP N OWN (shards | shards-: the caller's name) -> QERL_SHARD_DIRS (N directories), or exit 2
  local d i n=$2 own=${3/%-/-0} other=shards-0 step k
  printf -v d '%s/step-%06d' "$RUN_DIR" "$1"; step=${d##*/}  # qerl_step_dir without a subshell: every step is checked
  [ "$own" = shards ] || other=shards
  _qerl_split_of "$d" "$n"; k=$QERL_SPLIT
  # Any shards-<i> of the chain's count is its own rollout: its task 0 may have failed before it wrote.
  if [ "$n" -gt 1 ] && [ "$k" = 0 ] && _qerl_has "$d" shards && ! _qerl_has "$d" 'shards-[0-9]*'; then
    _qerl_die "$step holds grpo.sh's rollout (one shard, $step/shards): continue this run with grpo.sh, or with ROLLOUT_SHARDS=1"
  fi
  if [ "$n" -gt 1 ] && [ "$k" = 1 ]; then  # a one-task chain's shard 0 of 1 (and maybe grpo.sh's beside it)
    _qerl_die "$step holds a one-shard rollout ($step/shards-0, a one-task chain's$(_qerl_has "$d" shards &&
      echo ", and $step/shards, grpo.sh's")), not $n shards: continue this run with ROLLOUT_SHARDS=1, or with grpo.sh"
  fi
  if [ "$k" -gt 1 ] && { [ "$n" -gt 1 ] || ! _qerl_has "$d" shards; }; then
    if [ "$own" = shards ]; then
      _qerl_die "$step holds a Slurm chain's rollout in $k shards ($step/shards-<i>): continue this run with" \
        "recipes/slurm/submit.sh and ROLLOUT_SHARDS=$k"
    fi
    _qerl_die "$step holds a Slurm chain's rollout in $k shards ($step/shards-<i>), not ROLLOUT_SHARDS=$n: continue" \
      "this run with ROLLOUT_SHARDS=$k"
  fi
  QERL_SHARD_DIRS=()
  if [ "$n" -gt 1 ]; then
    for ((i = 0; i < n; i++)); do QERL_SHARD_DIRS+=("$d/shards-$i"); done
  elif [ "$k" -gt 1 ]; then  # beside a chain's split: grpo.sh's one shard, the one rollout of one shard there
    QERL_SHARD_DIRS=("$d/shards")
  elif ! _qerl_has "$d" "$own" && _qerl_has "$d" "$other"; then
    QERL_SHARD_DIRS=("$d/$other")
  else
    QERL_SHARD_DIRS=("$d/$own")
  fi
}
# Whether DIR's shards-<i> directories (finished or under way) fit a rollout in N shards: QERL_SPLIT is 0 where they do
# (or tell nothing: none, or shards-0 with no file yet), else the number of shards they show: the N of a file's name
# (shard-I-of-N.jsonl) that is not N, or one more than a highest i >= N. Fewer directories than N fit: a chain's task
# that failed before it wrote (or never started) leaves none, and its resubmission must go on.
_qerl_split_of() {  # DIR N -> QERL_SPLIT
  local f g
  QERL_SPLIT=0
  for f in "$1"/shards-[0-9]* "$1"/.shards-[0-9]*.partial-*; do
    if ! [[ ${f##*/} =~ ^\.?shards-([0-9]+)($|\.partial-) ]] || ! [ -e "$f" ]; then continue; fi
    if (( 10#${BASH_REMATCH[1]} >= $2 && 10#${BASH_REMATCH[1]} >= QERL_SPLIT )); then
      QERL_SPLIT=$((10#${BASH_REMATCH[1]} + 1))
    fi
    for g in "$f"/shard-*-of-*.jsonl; do
      if [[ $g =~ -of-([0-9]+)\.jsonl$ ]] && [ -e "$g" ] && (( 10#${BASH_REMATCH[1]} != $2 )); then
        QERL_SPLIT=$((10#${BASH_REMATCH[1]})); return
      fi
    done
  done
}
_qerl_has() {  # DIR NAME (a glob): DIR/NAME, finished or under way (a stage's .NAME.partial-<fingerprint>)
  # DIR quoted, NAME a pattern: `compgen -G "$1/$2"` read a RUN_DIR "run[1]" or "run?" as a pattern too, missing
  # its steps' directories and finding a sibling run dir's (run1, runA): a fresh run dir was refused.
  local f
  # shellcheck disable=SC2231  # NAME unquoted: the pattern
  for f in "$1"/$2 "$1"/.$2.partial-*; do
    if [ -e "$f" ]; then return 0; fi
  done
  return 1
}

# SHUFFLE: whether every rollout of the run reshuffles the prompts each epoch (rollout --shuffle, seeded by RUN_SEED),
# as the reference (TRL/verl-style) trainer does; until session 58 the recipes read them in file order, each pass over
# the dataset the same. The flag is in each rollout's fingerprint, so one run's rollouts must all agree: turned on in a
# run dir begun without it, the next rollout refused (exit 4) and FORCE=1 redid the run. `auto` is on for a new run dir
# (no step holds a rollout) and, in a begun one, what its rollouts were made with: the first finished one's manifest
# (recipes/rollout_shuffle.py; step 0's, unless pruned), else (only rollouts under way) RUN_DIR/shuffle, the choice
# written when the run dir was new, and without that file 0: the recipes before the knob began rollouts without it.
# 1 or 0 is taken as it is (a run dir of the other choice: its next rollout refuses).
qerl_resolve_shuffle() {  # -> SHUFFLE (1 or 0), after qerl_set_base; writes RUN_DIR/shuffle for a new run dir
  local recorded=""
  if ! _qerl_any_rollout; then
    if [ "$SHUFFLE" = auto ]; then SHUFFLE=1; fi
    mkdir -p -- "$RUN_DIR" && echo "$SHUFFLE" > "$RUN_DIR/shuffle"
    return
  fi
  [ "$SHUFFLE" = auto ] || return 0
  qerl_find_python ||
    _qerl_die "SHUFFLE=auto: reading how $RUN_DIR's rollouts were made takes a Python 3 on this host, and none was" \
      "found ($QERL_PYTHON_LOOKED): set PYTHON=/path/to/python3, or SHUFFLE=1 or 0"
  recorded=$("$QERL_PYTHON" "$QERL_LIB_DIR/rollout_shuffle.py" "$RUN_DIR" "$STEPS") ||
    _qerl_die "SHUFFLE=auto: cannot read how $RUN_DIR's rollouts were made (above; $QERL_PYTHON reads their" \
      "manifests): set SHUFFLE=1 or 0"
  if [ -z "$recorded" ] && [ -f "$RUN_DIR/shuffle" ]; then recorded=$(< "$RUN_DIR/shuffle"); fi
  case "$recorded" in
    1 | 0) SHUFFLE=$recorded ;;
    "") SHUFFLE=0 ;;
    *) _qerl_die "$RUN_DIR/shuffle holds '$recorded', not 1 or 0: set SHUFFLE=1 or 0" ;;
  esac
  if [ "$SHUFFLE" = 0 ]; then
    echo "note: SHUFFLE=auto: $RUN_DIR's rollouts were made in file order (no --shuffle), so this run keeps that" \
      "order; a new RUN_DIR reshuffles the prompts each epoch" >&2
  fi
}
_qerl_any_rollout() {  # whether a step of the run (below STEPS) holds a rollout, finished or under way
  local d n
  for d in "$RUN_DIR"/step-*; do
    n=${d##*/step-}
    if [[ $n =~ ^[0-9]+$ ]] && (( 10#$n < STEPS )) && { _qerl_has "$d" shards || _qerl_has "$d" 'shards-[0-9]*'; }; then
      return 0
    fi
  done
  return 1
}

# The step a rerun starts qerl from: the last with a finished adapter when every adapter before it is of the same
# run (recipes/resume_point.py), else 0; 0 too with FORCE=1, and without a Python 3 on the host, said where a step
# holds an adapter (it went through every step silently: 35 minutes of "already done" for 500 steps). Not in a
# subshell (`$(...)`), so that the Python it finds, and its note on a PYTHON it skips, are the script's: said once.
QERL_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
qerl_resume_point() {  # -> QERL_FIRST
  local first=0
  if [ "${FORCE:-0}" = 1 ]; then :
  elif ! qerl_find_python; then
    if _qerl_any_adapter; then
      echo "note: no Python 3 found on this host ($QERL_PYTHON_LOOKED) to read where $RUN_DIR's finished steps end" \
        "(recipes/resume_point.py): every step is gone through from step 0; set PYTHON=/path/to/python3 to skip them" >&2
    fi
  elif ! first=$("$QERL_PYTHON" "$QERL_LIB_DIR/resume_point.py" "$RUN_DIR" "$STEPS" 2>/dev/null); then
    first=0
  fi
  # shellcheck disable=SC2034  # the callers' (grpo.sh, submit.sh)
  QERL_FIRST=$first
}
_qerl_any_adapter() {  # whether a step of RUN_DIR holds a finished adapter
  local f
  for f in "$RUN_DIR"/step-*/adapter/manifest.json; do
    if [ -e "$f" ]; then return 0; fi
  done
  return 1
}

# The Python 3 that runs the recipes' helpers on the host (recipes/rollout_shuffle.py and resume_point.py, standard
# library only; the death signal's prctl): PYTHON where set, else python3 on PATH, else the Python that QERL runs:
# one beside an absolute qerl (/venv/bin/qerl -> /venv/bin/python3 or python) or QERL's own first word
# (QERL="python -m qerl_cli"), else python on PATH where it is Python 3. "python3" alone failed a host without one
# (SHUFFLE=auto exited 2, the resume shortcut was silently gone; a review, session 59). A container's Python (a QERL
# wrapper) is not the host's: set PYTHON there. Found once per script.
# A PYTHON that is no Python 3 that runs is named in a note and passed over for the others: it stopped the search,
# and the script then said "no Python 3 found" with python3 on PATH (SHUFFLE=auto in a begun run dir exited 2, the
# resume went through every step; session 59's list). Not an error: PYTHON is other tools' variable too (node-gyp's,
# a Makefile's PYTHON=python2), and any Python 3 runs these helpers (the standard library, 3.6 on).
QERL_PYTHON="" QERL_PYTHON_LOOKED=""
qerl_find_python() {  # -> QERL_PYTHON (a command), or returns 1 naming in QERL_PYTHON_LOOKED where it looked
  local words c cands=()
  if [ -n "$QERL_PYTHON" ]; then return 0; fi
  if [ -n "${PYTHON:-}" ]; then
    if _qerl_is_python3 "$PYTHON"; then QERL_PYTHON=$PYTHON; return 0; fi
    if [ -z "$QERL_PYTHON_LOOKED" ]; then  # once a script (set where none was found: a second search says none)
      echo "note: PYTHON=$PYTHON is not a Python 3 (3.6 or later) that runs here: the recipes' helpers look for another" >&2
    fi
  fi
  read -r -a words <<< "${QERL:-qerl}"
  cands=(python3)
  case "${words[-1]}" in /*/qerl) cands+=("${words[-1]%/*}/python3" "${words[-1]%/*}/python") ;; esac
  case "${words[0]##*/}" in python*) cands+=("${words[0]}") ;; esac
  cands+=(python)
  for c in "${cands[@]}"; do
    if _qerl_is_python3 "$c"; then QERL_PYTHON=$c; return 0; fi
  done
  QERL_PYTHON_LOOKED="looked for ${PYTHON:+PYTHON=$PYTHON (not Python 3.6+) and }${cands[*]}"
  return 1
}
# 3.6 or later: the helpers' f-strings are a SyntaxError before, so a host python3 of 3.4 or 3.5 (SLES 12's, Ubuntu
# 16.04's) was taken and then, where the death signal needs it (no setpriv), started no stage at all (review s60r08).
_qerl_is_python3() {  # COMMAND: whether it runs and is Python 3.6 or later
  command -v -- "$1" > /dev/null && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 6))' 2> /dev/null
}

# The step directories at or past STEPS, one a line: an earlier run's, when FORCE=1 reran a run dir with fewer STEPS
# (their adapters descend from that run's, not this one's). The loop never touches them: grpo.sh names them at its
# end and recipes/plot_run.py leaves them out; they are the user's to delete or move.
qerl_steps_past_the_end() {
  local d n
  for d in "$RUN_DIR"/step-*; do
    n=${d##*/step-}
    if [[ $n =~ ^[0-9]+$ ]] && (( 10#$n >= STEPS )); then echo "${d##*/}"; fi
  done
}

# The frozen base every stage loads: RUN_DIR/base (NVFP4, QeRL) or the bf16 checkpoint itself.
qerl_set_base() {  # RUN_DIR
  RUN_DIR=$1
  # A RUN_DIR "-x" read as an option: mkdir's "invalid option -- 'x'", eval --compare's "No such option: -x".
  case "$RUN_DIR" in -*) RUN_DIR=./$RUN_DIR ;; esac
  if [ "$BASE_FORMAT" = nvfp4 ]; then BASE=$RUN_DIR/base; else BASE=$MODEL; fi
}

# Whether the policy after step S is scored (EVAL_EVERY; the last step's is the merged one, eval-final).
qerl_eval_due() {  # STEP
  [ -n "$EVAL_DATASET" ] && [ "$EVAL_EVERY" -gt 0 ] && (( ($1 + 1) % EVAL_EVERY == 0 && $1 + 1 < STEPS ))
}
qerl_eval_missing() {  # STEP: due and not finished (a resumed run's steps before its resume point)
  qerl_eval_due "$1" && ! [ -f "$(qerl_step_dir "$1")/eval/manifest.json" ]
}

# Each *_cmd sets QERL_CMD to one qerl command line (the subcommand first), for "$QERL" or torchrun.
_qerl_adapter_before() {  # STEP -> QERL_ADAPTER: the adapter step STEP starts from (none for step 0)
  QERL_ADAPTER=()
  if [ "$1" -gt 0 ]; then QERL_ADAPTER=(--adapter "$(qerl_step_dir $(($1 - 1)))/adapter"); fi
}

# The same instruction around every prompt for rollout and eval (empty: the rows' prompts as they are),
# a Jinja chat template for a tokenizer without one (a base model's), for `messages` rows, and the template's
# extra variables (Qwen3's enable_thinking): a policy is scored on the prompts it was trained on. And the columns
# holding the prompt and the reference where the datasets name them otherwise (a chat set's `final_answer`): the
# recipes passed neither flag, and such a dataset could not be run without rewriting it (a review). And the system
# prompt and the stop string, for the same reason: none reached the recipes' stages (a review, session 59).
# The columns are the dataset's (PROMPT_KEY for DATASET, EVAL_PROMPT_KEY for EVAL_DATASET); the rest the policy's,
# one for both: a policy is scored as it was prompted. STOP may be an array, one --stop each: a second stop in the
# config's STOP=(...) was dropped without a word (bash's $STOP is its first).
_qerl_template_flags() {  # PROMPT_KEY ANSWER_KEY (the dataset's)
  local stop
  QERL_TEMPLATE=()
  if [ -n "$SYSTEM_PROMPT" ]; then QERL_TEMPLATE+=(--system-prompt "$SYSTEM_PROMPT"); fi
  for stop in "${STOP[@]}"; do
    if [ -n "$stop" ]; then QERL_TEMPLATE+=(--stop "$stop"); fi
  done
  if [ -n "$1" ]; then QERL_TEMPLATE+=(--prompt-key "$1"); fi
  if [ -n "$2" ]; then QERL_TEMPLATE+=(--answer-key "$2"); fi
  if [ -n "$PROMPT_TEMPLATE" ]; then QERL_TEMPLATE+=(--prompt-template "$PROMPT_TEMPLATE"); fi
  if [ -n "$CHAT_TEMPLATE_FILE" ]; then QERL_TEMPLATE+=(--chat-template-file "$CHAT_TEMPLATE_FILE"); fi
  if [ -n "$CHAT_TEMPLATE_KWARGS" ]; then QERL_TEMPLATE+=(--chat-template-kwargs "$CHAT_TEMPLATE_KWARGS"); fi
}

qerl_quantize_cmd() { QERL_CMD=(quantize "$MODEL" --out "$RUN_DIR/base" --device "$DEVICE"); }

qerl_rollout_cmd() {  # STEP OUT [FLAG...]: step STEP's rollout, with adapter STEP-1, into OUT
  local s=$1 out=$2 r rewards=() shuffle=()
  shift 2
  case "$SHUFFLE" in
    1) shuffle=(--shuffle) ;;
    0) ;;
    *) _qerl_die "SHUFFLE=$SHUFFLE: qerl_resolve_shuffle decides it before the first rollout" ;;
  esac
  # REWARDS: names word-split ("gsm8k format"), or a bash array in the config, one --reward an element, kept whole (a
  # file.py:function path with a space): `$REWARDS` of REWARDS=(gsm8k format) passed gsm8k alone, without a word
  # shellcheck disable=SC2153  # the config sets REWARDS
  if _qerl_is_array REWARDS; then
    for r in "${REWARDS[@]}"; do if [ -n "$r" ]; then rewards+=(--reward "$r"); fi; done
  else
    for r in $REWARDS; do rewards+=(--reward "$r"); done
  fi
  _qerl_adapter_before "$s"
  _qerl_template_flags "$PROMPT_KEY" "$ANSWER_KEY"
  QERL_CMD=(rollout --model "$BASE" "${QERL_ADAPTER[@]}" --prompts "$DATASET" --out "$out" "$@"
    --step "$s" --prompts-per-step "$PROMPTS_PER_STEP" "${shuffle[@]}" --num-generations "$NUM_GENERATIONS"
    --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --top-p "$TOP_P" "${rewards[@]}" "${QERL_TEMPLATE[@]}"
    --aqn-sigma-start "$AQN_SIGMA_START" --aqn-sigma-end "$AQN_SIGMA_END" --aqn-stages "$AQN_STAGES"
    --total-steps "$STEPS" --run-seed "$RUN_SEED" --seed "$SEED" --device "$DEVICE" --dtype "$DTYPE")
}

qerl_train_cmd() {  # STEP --shards DIR...: step STEP's train-step, from adapter STEP-1, into step-STEP/adapter
  local s=$1 extra=()
  shift
  read -r -a extra <<< "$TRAIN_EXTRA"  # extra train-step flags from the config, word-split
  _qerl_adapter_before "$s"
  QERL_CMD=(train-step --model "$BASE" "${QERL_ADAPTER[@]}" "$@" --out "$(qerl_step_dir "$s")/adapter"
    --loss "$LOSS" --clip-eps "$CLIP_EPS" --clip-eps-high "$CLIP_EPS_HIGH" --beta "$BETA" --tis-cap "$TIS_CAP"
    --lr "$LR" --warmup-steps "$WARMUP_STEPS" --total-steps "$STEPS" --max-grad-norm "$MAX_GRAD_NORM"
    --lora-rank "$LORA_RANK" --lora-alpha "$LORA_ALPHA" --micro-batch-tokens "$MICRO_BATCH_TOKENS"
    --seed "$SEED" --device "$DEVICE" --dtype "$DTYPE" --metrics-file "$RUN_DIR/metrics.jsonl" "${extra[@]}")
}

qerl_eval_cmd() {  # -1 | STEP | final: the base policy into eval-base, base + adapter STEP into
  local policy=(--model "$BASE") out  # step-STEP/eval, or the merged model into eval-final
  case "$1" in
    -1) out=$RUN_DIR/eval-base ;;
    final) policy=(--model "$RUN_DIR/merged"); out=$RUN_DIR/eval-final ;;
    *) policy+=(--adapter "$(qerl_step_dir "$1")/adapter"); out=$(qerl_step_dir "$1")/eval ;;
  esac
  _qerl_template_flags "$EVAL_PROMPT_KEY" "$EVAL_ANSWER_KEY"
  QERL_CMD=(eval "${policy[@]}" --dataset "$EVAL_DATASET" --max-new-tokens "$MAX_NEW_TOKENS" --device "$DEVICE"
    --dtype "$DTYPE" "${QERL_TEMPLATE[@]}")
  if [ "$EVAL_MAX_PROBLEMS" != 0 ]; then QERL_CMD+=(--max-problems "$EVAL_MAX_PROBLEMS"); fi
  QERL_CMD+=(--out "$out")
}

qerl_merge_cmd() {  # the last step's adapter merged into RUN_DIR/merged
  QERL_CMD=(merge --model "$BASE" --adapter "$(qerl_step_dir $((STEPS - 1)))/adapter" --out "$RUN_DIR/merged"
    --dtype "$MERGE_DTYPE")
  # An FP4 merge keeps a small RL update only when it is added to the bf16 source (docs/merge-eval.md).
  if [ "$MERGE_DTYPE" = nvfp4 ] && [ "$BASE" != "$MODEL" ]; then QERL_CMD+=(--requantize-from "$MODEL"); fi
  # the merged checkpoint carries the template the rollouts rendered with: the base's tokenizer files lack it
  if [ -n "$CHAT_TEMPLATE_FILE" ]; then QERL_CMD+=(--chat-template-file "$CHAT_TEMPLATE_FILE"); fi
}

qerl_compare_cmd() { QERL_CMD=(eval --compare "$RUN_DIR/eval-base" "$RUN_DIR/eval-final"); }

# Why a stage failed, in its own words: `qerl_run_recording CMD...` runs CMD with QERL_ERROR_FILE naming a file in
# RUN_DIR, to which a qerl stage that fails with one of its errors appends "CODE KIND MESSAGE" (qerl_cli.cli.record_error;
# each torchrun rank its own line), and sets QERL_FAILED to those lines (empty: none). The notes after a refusal are
# chosen from it: any exit 4 of an eval got the note on an eval begun on another GPU model, and any failure of a
# torchrun job the refusal's (a review, session 59). Not read from the stage's stderr, which stays the terminal's
# (through a pipe its live progress ends). In RUN_DIR, which a stage writes through any QERL wrapper (a container's
# /tmp may be its own); made by the stage only when it fails, removed once read.
# Behind a QERL wrapper the file is named on qerl's command line too: the slot qerl_read_qerl leaves there. So are the
# variables named in QERL_CARRIED that are set, which such a wrapper dropped too: grpo.sh's QERL_STOP_WITH_PARENT (a
# stage under a wrapper that forks it and dies of the TERM passed on when grpo.sh is killed ran on, orphaned) and
# stage.sbatch's TRITON_CACHE_DIR in the run dir (each job compiled its kernels anew, or kept them in $HOME).
QERL_CARRIED=(QERL_STOP_WITH_PARENT)
qerl_run_recording() {  # CMD... -> CMD's status; QERL_FAILED
  local rc=0 f w v cmd=() slot=1
  f=$(mktemp -u "$RUN_DIR/.qerl-error.XXXXXXXXXX") || f=""
  for w in "$@"; do
    cmd+=("$w")
    if [ "$slot" = 1 ] && [ "$w" = QERL_ERROR_FILE= ]; then
      cmd[-1]=QERL_ERROR_FILE=$f slot=0
      for v in "${QERL_CARRIED[@]}"; do
        if [ -n "${!v+x}" ]; then cmd+=("$v=${!v}"); fi
      done
    fi
  done
  QERL_ERROR_FILE=$f "${cmd[@]}" || rc=$?
  QERL_FAILED=""
  if [ -n "$f" ] && [ -f "$f" ]; then QERL_FAILED=$(< "$f"); rm -f -- "$f"; fi
  return "$rc"
}
QERL_FAILED=""
# QERL's words -> QERL_WORDS (grpo.sh's and the Slurm jobs' stages run "${QERL_WORDS[@]}" SUBCOMMAND ...). QERL may
# put a wrapper first, word-split as CC="ccache gcc" is: QERL="apptainer exec img.sif qerl". Between such a wrapper
# and qerl (its last word `qerl`, or `python... -m qerl_cli`) goes `env QERL_ERROR_FILE=`, which qerl_run_recording
# fills in: a wrapper that starts qerl with an environment of its own (apptainer exec --cleanenv, docker run without
# -e, srun --export=NONE) dropped the variable, and the notes chosen from the record with it (session 59's list). It
# needs `env` where qerl runs, and the run dir at the same path there (where the stages write their --out anyway).
# Another QERL (a script of the user's that runs qerl) passes it in the environment alone.
# QERL_WRAPPER: the words before qerl's own, the slot included (none without a wrapper): a Slurm train job of several
# GPUs runs torchrun in them (stage.sbatch).
qerl_read_qerl() {  # -> QERL_WORDS, QERL_WRAPPER
  local n
  read -r -a QERL_WORDS <<< "${QERL:-qerl}"
  QERL_WRAPPER=()
  n=${#QERL_WORDS[@]}
  if [ "${QERL_WORDS[n - 1]##*/}" = qerl ]; then
    n=$((n - 1))
  elif [ "$n" -ge 3 ] && [ "${QERL_WORDS[*]:n-2}" = "-m qerl_cli" ] && [[ ${QERL_WORDS[n - 3]##*/} == python* ]]; then
    n=$((n - 3))
  else
    return 0
  fi
  if [ "$n" -gt 0 ]; then
    QERL_WRAPPER=("${QERL_WORDS[@]:0:n}" env QERL_ERROR_FILE=)
    QERL_WORDS=("${QERL_WRAPPER[@]}" "${QERL_WORDS[@]:n}")
  fi
}
qerl_failed_with() {  # CODE [KIND]: whether a line of QERL_FAILED records that exit code (and that kind of error)
  [[ $'\n'$QERL_FAILED == *$'\n'"$1 ${2:+$2 }"* ]]
}

# `qerl_run_forwarding CMD...`: CMD, reading /dev/null, in a process group of its own, passing TERM, INT, HUP and
# QUIT on to that group (HUP and QUIT as TERM: a closed terminal, Ctrl-\; a qerl stage cleans up as after TERM);
# returns CMD's status. bash ignores SIGQUIT: Ctrl-\ reached nothing of a stage in its own group.
# bash passes no signal to a foreground child, so `kill <script pid>` stopped a script alone and left what it ran
# going, orphaned: grpo.sh's stage, quickstart.sh's loop, compare_aqn.sh's xargs starting the rest of its runs
# (reviews). The group is CMD's own (a background job of a script without job control ignores SIGINT), so a signal
# to the script's group reaches CMD once, through here; and the whole group, as Ctrl-C and Slurm signal it: a
# wrapper that passes no signal on (QERL="/usr/bin/time qerl" ignores SIGINT) left the stage running.
# After a signal the script ends once CMD has, and ends as killed by that signal (its caller's $?: 128 + its number,
# as before), or with CMD's status when CMD failed some other way. It returned CMD's status, which a caller's `||`
# read as a failure (compare_aqn.sh's "FAILED: the shared base"), and grpo.sh exited 130 after Ctrl-C: bash, seeing
# a normal exit, took the signal as handled and went on with a loop around it (a review). Between two calls the
# signals act as by default: the script dies of them.
# The script's death passes SIGTERM on too, whatever killed it (`kill -9`, `timeout -k`, the OOM killer): CMD is
# started set to get it from the kernel (_qerl_exec_stopping_with). A `kill -9 <quickstart.sh pid>` left grpo.sh's
# loop running orphaned, starting its next stages, and compare_aqn.sh's xargs the rest of its runs (a review). CMD
# then stops as after a `kill`: a bash script running its own command through here (grpo.sh, compare_aqn.sh's
# relay) passes the TERM on to that command's group; a qerl stage cleans up.
# Ctrl-Z (SIGTSTP) is passed on to CMD's group before the script stops itself, and SIGCONT after it resumes (`fg`,
# `bg`): the terminal stops the script's group alone, and CMD ran on while the script was stopped. SIGCONT itself is
# not trapped: `timeout` and systemd send SIGTERM and SIGCONT at once, and bash then ran the CONT trap alone, the TERM
# lost (a review). The caller's own traps for these signals are back after CMD has ended, and run if it dies of one.
_qerl_group=""      # CMD's group while it runs; "starting" until bash has started it
_qerl_pending=""    # the signal to pass on that came while starting
_qerl_signal=""     # the last signal that came
_qerl_signals=0     # how many came (each ends a `wait` early)
_qerl_forward() {  # SIGNAL: one that came
  local pass=$1
  case "$1" in HUP | QUIT) pass=TERM ;; esac
  _qerl_signal=$1; _qerl_signals=$((_qerl_signals + 1))
  case "$_qerl_group" in
    "") _qerl_die_of "$1" ;;
    # bash runs a trap as soon as it has forked CMD, before `$!` gives its id: passed on once it does (the script
    # exited, CMD ran on orphaned).
    starting) _qerl_pending=$pass ;;
    *) kill -s "$pass" -- "-$_qerl_group" 2>/dev/null || true ;;
  esac
}
_qerl_pass_stop() {  # Ctrl-Z; not a stop, so the script goes on waiting
  _qerl_signals=$((_qerl_signals + 1))
  case "$_qerl_group" in "" | starting) kill -s STOP "$BASHPID"; return ;; esac
  kill -s TSTP -- "-$_qerl_group" 2>/dev/null || true
  kill -s STOP "$BASHPID"  # as TSTP's default would; on from here once resumed (`fg`, `bg`)
  kill -s CONT -- "-$_qerl_group" 2>/dev/null || true
}
_qerl_traps=""  # the caller's traps for the signals passed on (trap -p), put back after CMD
_qerl_restore_traps() {
  trap - TERM INT HUP QUIT TSTP
  eval "$_qerl_traps"
}
_qerl_die_of() {  # SIGNAL: end the script (this subshell, in one) as killed by it, or as the caller's trap for it does
  _qerl_restore_traps
  kill -s "$1" "$BASHPID"  # $$ was the script itself, from a subshell (`qerl_run_forwarding CMD &`)
  exit $((128 + $(kill -l "$1")))  # not reached unless the signal is blocked, or QUIT (bash ignores it)
}
qerl_run_forwarding() {
  local rc seen parent=$BASHPID
  _qerl_find_death_tool
  _qerl_signal="" _qerl_pending="" _qerl_group=starting _qerl_traps=""
  # A subshell's `trap -p` shows its parent's traps, which do not run there: put back, they ran in it after a signal
  # (a script's "clean-up; exit 9" trap ended `(qerl_run_forwarding CMD) &` as 9, the clean-up run twice).
  if [ "$BASHPID" = "$$" ]; then _qerl_traps=$(trap -p TERM INT HUP QUIT TSTP); fi
  trap '_qerl_forward TERM' TERM
  trap '_qerl_forward INT' INT
  trap '_qerl_forward HUP' HUP
  trap '_qerl_forward QUIT' QUIT
  trap _qerl_pass_stop TSTP
  set -m; _qerl_exec_stopping_with "$parent" "$@" < /dev/null & _qerl_group=$!; set +m
  if [ -n "$_qerl_pending" ]; then kill -s "$_qerl_pending" -- "-$_qerl_group" 2>/dev/null || true; fi
  while :; do  # a signal ends a wait early: wait again, for CMD's own status
    seen=$_qerl_signals; rc=0; wait "$_qerl_group" || rc=$?
    if [ "$_qerl_signals" = "$seen" ]; then break; fi
  done
  _qerl_group=""
  _qerl_restore_traps
  if [ -n "$_qerl_signal" ]; then
    if [ "$rc" != 0 ] && [ "$rc" != $((128 + $(kill -l "$_qerl_signal"))) ]; then exit "$rc"; fi
    _qerl_die_of "$_qerl_signal"
  fi
  return "$rc"
}

# How CMD gets SIGTERM when the script dies: Linux's PR_SET_PDEATHSIG, which outlives exec. util-linux's
# `setpriv --pdeathsig` (2.33, 2018: Debian 10, Ubuntu 20.04, RHEL 9 and later), else a Python 3's prctl (RHEL 8's
# util-linux is 2.32; qerl_find_python's), else none (not Linux: the script's death passes nothing on). Found once per
# script.
_qerl_death_tool=""
_qerl_find_death_tool() {
  if [ -n "$_qerl_death_tool" ]; then return; fi
  _qerl_death_tool=none
  if [ "$(uname -s)" != Linux ]; then return; fi
  # The Python's prctl is ctypes', which a Python built without libffi lacks (pyenv's on a host without libffi-devel):
  # there every stage failed to start, "No module named '_ctypes'", exit 1 (review s60r08). Without it, none.
  if [[ $(setpriv --help 2>/dev/null) == *--pdeathsig* ]]; then _qerl_death_tool=setpriv
  elif qerl_find_python && "$QERL_PYTHON" -I -S -c 'import ctypes; ctypes.CDLL(None).prctl' 2> /dev/null; then
    _qerl_death_tool=python3
  fi
}
# `_qerl_exec_stopping_with PARENT CMD...` in a child of PARENT (a pid): become CMD, set to get SIGTERM when PARENT
# dies. A PARENT that died before that (the child re-parented, no signal will come) ends the child at once (143).
_qerl_exec_stopping_with() {
  local parent=$1
  shift
  # A shell function (a sourcing script's, or an exported one QERL names) is no file to exec ("exec: not found", or
  # the file of that name on PATH ran instead): it runs in this child, as before, without the death signal.
  if [ "$(type -t -- "$1")" = function ]; then "$@"; exit; fi
  # shellcheck disable=SC2016  # bash -c's own $PPID and arguments
  case "$_qerl_death_tool" in
    setpriv) exec setpriv --pdeathsig TERM -- "$BASH" -c '[ "$PPID" = "$0" ] || exit 143; exec "$@"' "$parent" "$@" ;;
    python3) exec "${QERL_PYTHON:-python3}" -I -S -c 'import ctypes, os, sys
if ctypes.CDLL(None).prctl(1, 15, 0, 0, 0) == 0 and os.getppid() != int(sys.argv[1]):  # PR_SET_PDEATHSIG, SIGTERM
    sys.exit(143)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:  # as bash says it
    print(f"{sys.argv[2]}: {e.strerror}", file=sys.stderr)
    sys.exit(127 if e.errno == 2 else 126)' "$parent" "$@" ;;
    *) exec "$@" ;;
  esac
}
