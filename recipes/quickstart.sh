#!/usr/bin/env bash
# qerl's first command: set up, then run a real RL loop on the bundled tiny model and task.
#
#   bash recipes/quickstart.sh [RUN_DIR]        (default runs/quickstart; CPU is enough)
#
# quantize -> STEPS x (rollout -> train-step) -> merge -> eval, printing the reward per step,
# then RUN_DIR/curves.png (reward, entropy, pass@1 per step). Rerun it to resume; after a changed knob,
# FORCE=1 redoes the stages it makes refuse (to start over, pass a new RUN_DIR).
# Knobs (environment): STEPS, LR, PROMPTS_PER_STEP, NUM_GENERATIONS, DEVICE, SEED, BASE_FORMAT.
set -euo pipefail
here=$PWD
cd "$(dirname "$0")/.."
# shellcheck source=recipes/lib.sh
source recipes/lib.sh  # before any install: --help only prints
qerl_help_if_asked recipes/quickstart.sh "${1:-}"
# A RUN_DIR you pass is read where you ran the command; the default lives in the repository.
case "${1:-}" in "") RUN_DIR=runs/quickstart ;; /*) RUN_DIR=$1 ;; *) RUN_DIR=$here/$1 ;; esac

if ! python -c "import torch" 2>/dev/null; then
  # The CPU build, or pip pulls several GB of CUDA wheels for the project's torch requirement.
  python -m pip install -q torch==2.13.0
fi
# Checked from / : in the repository root `import qerl_cli` finds the source tree itself, installed or not,
# and the loop below runs the `qerl` command, which only the install provides ("qerl: command not found").
# A QERL you set runs the stages instead: then only the plot's matplotlib is checked here. (QERL="python -m qerl_cli"
# from this root still imports qerl_kernels, a name kernels/ has only through an install or a PYTHONPATH link to it:
# without one the first stage stops at "No module named 'qerl_kernels'"; with another checkout installed, it runs
# that checkout's kernels under this tree's qerl_cli.)
if ! (cd / && python -c "import matplotlib") 2>/dev/null \
   || { [ -z "${QERL:-}" ] && { ! (cd / && python -c "import qerl_cli") 2>/dev/null || ! command -v qerl >/dev/null; }; }; then
  python -m pip install -q -e ".[plot]"
fi
if [ -z "${QERL:-}" ]; then  # the qerl command runs whatever tree is installed: say so when it is another one
  installed=$(cd / && python -c "import os, qerl_cli; print(os.path.dirname(os.path.dirname(os.path.realpath(qerl_cli.__file__))))" 2>/dev/null) || installed=""
  if [ -n "$installed" ] && [ "$installed" != "$(pwd -P)" ]; then
    echo "note: the qerl command runs the checkout installed at $installed, not this one ($(pwd -P)); 'pip install -e .' here runs this one" >&2
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} TOKENIZERS_PARALLELISM=false

start=$(date +%s)
rc=0; qerl_run_forwarding bash recipes/grpo.sh recipes/configs/tiny.env "$RUN_DIR" || rc=$?  # a signal reaches the loop
[ "$rc" = 0 ] || exit "$rc"
if [ -f "$RUN_DIR/metrics.jsonl" ]; then
  python recipes/plot_run.py "$RUN_DIR"
  echo "quickstart finished in $(( $(date +%s) - start )) s; curves: $RUN_DIR/curves.png"
else  # STEPS=0: the base policy only, no step to plot (plot_run.py stopped the script with exit 1)
  echo "quickstart finished in $(( $(date +%s) - start )) s; no RL steps (STEPS=0), so no curves"
fi
