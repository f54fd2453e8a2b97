"""The bash and Slurm recipes: syntax, the dependency chain, and the stage commands they run.

The Slurm chain is checked with a recording stand-in for ``sbatch`` and, where slurm-wlm is
installed, under a live single-node Slurm started by the test; the stage script is run with a
recording stand-in for ``qerl`` so every generated command line is checked without running a model.
"""

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CONFIGS = sorted((RECIPES / "configs").glob("*.env"))


def _qwen_cfg(tmp_path: Path, settings: str) -> Path:
    """tmp_path/c.env: the Qwen2.5-7B config with ``settings`` appended."""
    cfg = tmp_path / "c.env"
    cfg.write_text((RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text() + settings)
    return cfg


def _recorder(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text("#!/usr/bin/env bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


@pytest.mark.parametrize("script", sorted(RECIPES.rglob("*.sh")) + sorted(RECIPES.rglob("*.sbatch")), ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_configs_define_what_the_loop_needs(config):
    keys = "MODEL DATASET STEPS PROMPTS_PER_STEP NUM_GENERATIONS MAX_NEW_TOKENS LR LORA_RANK LORA_ALPHA LOSS CLIP_EPS CLIP_EPS_HIGH TIS_CAP"
    out = subprocess.run(["bash", "-c", f"set -u; source {config}; for k in {keys}; do echo $k=${{!k}}; done"],
                         capture_output=True, text=True, check=True).stdout
    values = dict(line.split("=", 1) for line in out.splitlines())
    assert all(values[k] for k in keys.split()), values
    if "qwen2.5" in config.name:
        assert values["LOSS"] == "dapo" and values["CLIP_EPS_HIGH"] == "0.28" and values["LORA_RANK"] == "16"
    # and recipes/lib.sh's check (every key a stage reads, BASE_FORMAT, the whole numbers) takes it
    subprocess.run(["bash", "-c", f"set -euo pipefail; source {config}; source {RECIPES / 'lib.sh'}; qerl_load_config {config}"],
                   check=True)


# The paper's reference settings (its public scripts; ../shared/docs/qerl-method.md, "Reference hyperparameters"), as
# the stages read them: the Qwen configs' flags and, where a config passes none, the stage's default. The test read
# only LOSS, CLIP_EPS_HIGH and LORA_RANK of the configs' own text: a config's bf16 baseline ran at NVFP4's LR, and a
# changed stage default (AdamW's betas, weight decay, the LoRA targets) would have changed every recipe unsaid.
PAPER_TRAIN = {"loss": "dapo", "beta": 0.0, "clip_eps": 0.2, "clip_eps_high": 0.28, "lora_rank": 16, "lora_alpha": 16,
               "adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": 0.1, "max_grad_norm": 0.2, "min_lr_ratio": 0.0,
               "epochs": 1}
PAPER_LR = {"nvfp4": 1e-5, "bf16": 5e-6}
PAPER_ROLLOUT = {"max_new_tokens": 2048, "aqn_sigma_start": 1e-2, "aqn_sigma_end": 1e-4, "aqn_stages": 10}


def _stage_config(config: Path, cmd: str, env: dict, cwd: Path | None = None):
    """The stage config (TrainStepConfig, RolloutConfig, EvalConfig) that the command line lib.sh's ``cmd`` builds from
    ``config`` (sourced with ``env`` as the whole environment, RUN_DIR ``run`` in ``cwd``) gives the stage: parsed by
    the stage's own CLI, its defaults filled in, caught before it runs."""
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    out = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{config}"; source "{RECIPES / "lib.sh"}"; '
                          f'qerl_load_config "{config}"; qerl_set_base run; {cmd}; printf "%s\\0" "${{QERL_CMD[@]}}"'],
                         env=env, capture_output=True, text=True, check=True, cwd=cwd).stdout
    args = out.split("\0")[:-1]
    target = {"train-step": "qerl_cli.train_step.train_step", "rollout": "qerl_cli.rollout.rollout",
              "eval": "qerl_cli.evaluate.evaluate"}[args[0]]
    got = []

    def caught(cfg, *_, **__):
        got.append(cfg)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target, caught)
        r = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERMINAL_WIDTH": ""})
    assert got, f"{config.name}: qerl {' '.join(args)} -> exit {r.exit_code}: {r.stderr or r.stdout}"
    return got[0]


@pytest.mark.parametrize("base_format", ["nvfp4", "bf16"])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.name.startswith("qwen2.5-")], ids=lambda p: p.name)
def test_the_qwen_configs_run_the_stages_with_the_papers_settings(tmp_path, config, base_format):
    from qerl_cli.layers.lora import DEFAULT_TARGETS

    env = {k: v for k, v in os.environ.items() if k not in ("LR", "STEPS", "WARMUP_STEPS")} | {"BASE_FORMAT": base_format}
    train = _stage_config(config, "qerl_train_cmd 1 --shards s", env)
    assert {k: getattr(train, k) for k in PAPER_TRAIN} == PAPER_TRAIN
    assert train.lr == PAPER_LR[base_format]  # the reference: 1e-5 for NVFP4, 5e-6 for the 16-bit LoRA baseline
    # LoRA on all seven projections; 10% warmup, then cosine over the run
    assert train.lora_targets is None and set(DEFAULT_TARGETS) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                    "up_proj", "down_proj"}
    assert train.total_steps >= 100 and train.warmup_steps == train.total_steps // 10
    rollout = _stage_config(config, "qerl_resolve_shuffle; qerl_rollout_cmd 1 s", env, cwd=tmp_path)
    assert {k: getattr(rollout, k) for k in PAPER_ROLLOUT} == PAPER_ROLLOUT and rollout.total_steps == train.total_steps
    assert rollout.shuffle  # a new run dir's prompts reshuffled each epoch, as the reference trainer's (SHUFFLE=auto)
    ev = _stage_config(config, "qerl_eval_cmd 0", env)  # GSM8K pass@1, greedy, at the rollout's length
    assert (ev.k, ev.temperature, ev.max_new_tokens) == (1, None, 2048)


def _fake_sbatch(tmp_path):
    log = tmp_path / "sbatch.log"
    counter = tmp_path / "jid"
    counter.write_text("100")
    body = f'n=$(( $(cat {counter}) + 1 )); echo $n > {counter}; echo "$n $*" >> {log}; echo "$n;cluster"\n'
    return _recorder(tmp_path, "sbatch", body), log


def _jobs(log):
    """The fake sbatch's log as {job name: (id, args)}."""
    jobs = {}
    for line in log.read_text().splitlines():
        jid, args = line.split(" ", 1)
        jobs[args.split("--job-name ", 1)[1].split(" ", 1)[0]] = (int(jid), args)
    return jobs


def test_slurm_submit_chains_jobs_by_dependency(tmp_path):
    sbatch, log = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=3\nROLLOUT_SHARDS=4\n")
    env = {**os.environ, "SBATCH": str(sbatch), "PARTITION": "gpu"}
    out = subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, check=True).stdout
    jobs = _jobs(log)
    assert len(jobs) == 1 + 1 + 3 * 2 + 1, out  # quantize, eval-base (the config's EVAL_DATASET), 3 x 2, final
    ids = {name: jid for name, (jid, _) in jobs.items()}
    args = {name: a for name, (_, a) in jobs.items()}
    assert "quantize" in args["qerl-quantize"] and "--dependency" not in args["qerl-quantize"]
    prev = ids["qerl-quantize"]
    for s in range(3):
        roll, train = args[f"qerl-rollout-{s}"], args[f"qerl-train-{s}"]
        assert "--array 0-3" in roll and f" rollout {cfg} " in roll and roll.endswith(f" {s}")
        assert f"--dependency afterok:{prev} " in roll  # after quantize / previous train
        assert f"--dependency afterok:{ids[f'qerl-rollout-{s}']} " in train and " train " in train
        assert "--partition gpu" in roll and "--gres=gpu:1 " in roll  # one GPU per rollout task
        prev = ids[f"qerl-train-{s}"]
    assert f"afterok:{prev}:{ids['qerl-eval-base']} " in args["qerl-final"] and " final " in args["qerl-final"]
    # Log names: %a is 4294967294 outside an array, so only the rollout arrays use it.
    run = tmp_path / "run"
    for name, a in args.items():
        pattern = "slurm-%x-%A_%a.out" if "rollout" in name else "slurm-%x-%j.out"
        assert f"--output {run}/{pattern} " in a, (name, a)


def test_a_resubmitted_chain_starts_at_the_last_finished_step(tmp_path):
    # Each finished step took two GPU jobs only to say "already done" (a review, 2026-11-27); an eval missing before
    # the last finished step is submitted, on the base's job.
    sbatch, log = _fake_sbatch(tmp_path)
    cfg = tmp_path / "c.env"
    cfg.write_text((RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text()
                   + "\nWARMUP_STEPS=0\nSTEPS=5\nEVAL_EVERY=2\n")  # evals after steps 1 and 3
    run = tmp_path / "run"
    _finished_steps(run, 3)
    out = subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(run)], capture_output=True,
                         text=True, env={**os.environ, "SBATCH": str(sbatch)}, check=True).stdout
    jobs = _jobs(log)
    assert sorted(jobs, key=lambda n: jobs[n][0]) == [
        "qerl-quantize", "qerl-eval-base", "qerl-eval-1", "qerl-rollout-2", "qerl-train-2", "qerl-rollout-3",
        "qerl-train-3", "qerl-eval-3", "qerl-rollout-4", "qerl-train-4", "qerl-final"], out
    qid = jobs["qerl-quantize"][0]
    assert f"afterok:{qid} " in jobs["qerl-eval-1"][1] and f"afterok:{qid} " in jobs["qerl-rollout-2"][1]
    assert "steps 0-1: finished; the chain starts at step 2" in out


@pytest.mark.parametrize("scancel_works", [True, False])
def test_a_refused_sbatch_cancels_the_jobs_the_chain_submitted_before_it(tmp_path, scancel_works):
    # The jobs before it stayed queued and a rerun submitted them all again beside them (a review, 2026-11-27).
    sbatch, log = _fake_sbatch(tmp_path)
    real = sbatch.with_name("sbatch-ok")
    sbatch.rename(real)
    _recorder(tmp_path, "sbatch", f'[ "$(cat {tmp_path / "jid"})" -ge 104 ] && {{ echo "QOSMaxSubmitJobPerUserLimit" >&2; '
                                  f'exit 1; }}; exec {real} "$@"\n')
    cancelled = tmp_path / "scancel.log"
    scancel = _recorder(tmp_path, "scancel", f'echo "$*" >> {cancelled}\n' + ("" if scancel_works else "exit 1\n"))
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=3\n")
    env = {**os.environ, "SBATCH": str(sbatch), "SCANCEL": str(scancel)}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "run")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "error: sbatch refused job qerl-rollout-1; cancelling the 4 job(s)" in r.stderr, r.stderr
    assert cancelled.read_text().split() == ["101", "102", "103", "104"]
    assert ("scancel failed too: cancel them yourself: scancel 101 102 103 104" in r.stderr) is not scancel_works


def test_slurm_jobs_take_cores_and_memory_from_the_settings(tmp_path):
    # clusters default to one core and little memory a job; only EXTRA_SBATCH_ARGS could raise them
    sbatch, log = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\n")
    env = {**os.environ, "SBATCH": str(sbatch), "JOB_CPUS": "8", "JOB_MEM": "64G"}
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "run")], env=env,
                   check=True, capture_output=True)
    jobs = _jobs(log)
    assert len(jobs) >= 4 and all("--cpus-per-task 8 --mem 64G " in a for _, a in jobs.values()), jobs
    log.write_text("")
    env = {k: v for k, v in env.items() if k not in ("JOB_CPUS", "JOB_MEM")}
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "run2")], env=env,
                   check=True, capture_output=True)
    assert not any("--cpus-per-task" in a or "--mem" in a for _, a in _jobs(log).values())


def test_slurm_evals_run_beside_the_chain(tmp_path):
    # EVAL_EVERY was ignored under Slurm and the base eval ran in the final job, on the critical path.
    sbatch, log = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=5\nEVAL_EVERY=2\n")
    run = tmp_path / "run"
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(run)], check=True,
                   capture_output=True, env={**os.environ, "SBATCH": str(sbatch)})
    jobs = _jobs(log)
    ids = {name: jid for name, (jid, _) in jobs.items()}
    assert sorted(n for n in jobs if "eval" in n) == ["qerl-eval-1", "qerl-eval-3", "qerl-eval-base"]  # as grpo.sh
    base = jobs["qerl-eval-base"][1]
    assert f"--dependency afterok:{ids['qerl-quantize']} " in base and base.endswith(f" eval {cfg} {run} -1")
    for s in (1, 3):
        a = jobs[f"qerl-eval-{s}"][1]
        assert f"--dependency afterok:{ids[f'qerl-train-{s}']} " in a and a.endswith(f" eval {cfg} {run} {s}")
    # nothing waits for a per-step eval; the final job waits for the last train and the base eval
    deps = [a.split("afterok:", 1)[1].split(" ", 1)[0].split(":") for _, a in jobs.values() if "afterok:" in a]
    assert not {str(ids["qerl-eval-1"]), str(ids["qerl-eval-3"])} & {d for ds in deps for d in ds}
    assert f"--dependency afterok:{ids['qerl-train-4']}:{ids['qerl-eval-base']} " in jobs["qerl-final"][1]
    # without EVAL_DATASET: no eval job, and the final job waits for the last train alone
    log.write_text("")
    cfg.write_text(cfg.read_text() + "EVAL_DATASET=\n")
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(run)], check=True,
                   capture_output=True, env={**os.environ, "SBATCH": str(sbatch)})
    jobs = _jobs(log)
    assert not [n for n in jobs if "eval" in n]
    assert f"--dependency afterok:{jobs['qerl-train-4'][0]} " in jobs["qerl-final"][1]


def _stage(tmp_path, stage, step, extra=""):
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$*" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, f"\nWARMUP_STEPS=0\nSTEPS=5\nROLLOUT_SHARDS=2\n{extra}\n")
    env = {**os.environ, "QERL": str(qerl), "SLURM_ARRAY_TASK_ID": "1"}
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(tmp_path / "run"), str(step)],
                   env=env, check=True)
    return log.read_text().strip()


@pytest.mark.parametrize("preset", [None, "/shared/triton"])
def test_slurm_stages_share_compiled_kernels_through_the_run_dir(tmp_path, preset, monkeypatch):
    # Every job of a run finds the kernels an earlier job compiled, on whatever node (a set value wins).
    if preset:
        monkeypatch.setenv("TRITON_CACHE_DIR", preset)
    else:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    log = tmp_path / "env.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$TRITON_CACHE_DIR" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=5\n")
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(tmp_path / "run"), "1"],
                   env={**os.environ, "QERL": str(qerl)}, check=True)
    assert log.read_text().strip() == (preset or f"{tmp_path / 'run'}/.triton-cache")


def test_slurm_rollout_task_writes_its_own_shard_with_previous_adapter(tmp_path):
    cmd = _stage(tmp_path, "rollout", 2)
    run = tmp_path / "run"
    assert cmd.startswith(f"rollout --model {run}/base --adapter {run}/step-000001/adapter")
    assert f"--out {run}/step-000002/shards-1 --shard-index 1 --num-shards 2" in cmd
    assert "--step 2 " in cmd and "--aqn-sigma-start 1e-2" in cmd


def test_slurm_train_reads_every_shard_and_first_step_has_no_adapter(tmp_path):
    cmd = _stage(tmp_path, "train", 0)
    run = tmp_path / "run"
    assert "--adapter" not in cmd
    assert f"--shards {run}/step-000000/shards-0 --shards {run}/step-000000/shards-1" in cmd
    assert f"--out {run}/step-000000/adapter" in cmd and "--loss dapo" in cmd
    assert cmd.endswith("--offload-activations --embeddings-on-cpu --keep-activations auto")  # the 7B config's TRAIN_EXTRA


def test_multi_gpu_training_with_qerl_as_a_python_module_runs_a_bare_torchrun(tmp_path):
    # (review) QERL="python -m qerl_cli" had become `python -m torchrun ...`: only a last word `qerl` is
    # dropped for the wrapper
    log = tmp_path / "torchrun.log"
    _recorder(tmp_path, "torchrun", f'echo "$*" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=5\nTRAIN_GPUS=2\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHRUN"}
    env.update(QERL="python -m qerl_cli", PATH=f"{tmp_path}:{os.environ['PATH']}")
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(tmp_path / "run"), "0"],
                   env=env, check=True, capture_output=True)
    assert log.read_text().startswith("--nproc-per-node 2 -m qerl_cli train-step --model ")


@pytest.mark.parametrize("qerl", ["qerl", "python3 -m qerl_cli"])
@pytest.mark.parametrize("torchrun", [None, "/venv/bin/torchrun --rdzv-backend c10d"])
def test_multi_gpu_training_runs_torchrun_inside_the_qerl_wrapper(tmp_path, torchrun, qerl):
    # TRAIN_GPUS > 1 ran a bare `torchrun -m qerl_cli`, outside QERL's container (docs audit, session 44); behind a
    # wrapper's `python3 -m qerl_cli` it still did (review s60r08), where the job's other stages ran inside the wrapper
    log = tmp_path / "wrapper.log"
    wrapper = _recorder(tmp_path, "wrap", f'echo "$*" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=5\nTRAIN_GPUS=4\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHRUN", "TRITON_CACHE_DIR")}
    env["QERL"] = f"{wrapper} exec --nv img.sif {qerl}"
    if torchrun:
        env["TORCHRUN"] = torchrun
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(tmp_path / "run"), "0"],
                   env=env, check=True, capture_output=True)
    launcher = torchrun or "torchrun"
    # and the ranks' record of why they failed named inside it (qerl_read_qerl), and the run's kernel cache
    # (QERL_CARRIED): the wrapper may clear the environment
    import re

    assert re.match(rf"exec --nv img\.sif env QERL_ERROR_FILE={tmp_path}/run/\.qerl-error\.\w+ "
                    rf"TRITON_CACHE_DIR={tmp_path}/run/\.triton-cache {launcher} --nproc-per-node 4 "
                    "-m qerl_cli train-step --model ", log.read_text()), log.read_text()


@pytest.mark.parametrize("beside", [True, False])
def test_multi_gpu_training_takes_the_torchrun_beside_an_absolute_qerl(tmp_path, beside):
    # QERL=/venv/bin/qerl ran the first torchrun on PATH, another Python's without qerl_cli where the job has no
    # activated venv (a review, 2026-11-27); without a torchrun beside it, the one on PATH as before.
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "qerl").write_text("#!/bin/sh\n")
    (venv / "qerl").chmod(0o755)
    log = tmp_path / "torchrun.log"
    _recorder(tmp_path, "torchrun", f'echo "PATH $*" >> {log}\n')
    if beside:
        (venv / "torchrun").write_text(f'#!/bin/sh\necho "VENV $*" >> {log}\n')
        (venv / "torchrun").chmod(0o755)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=5\nTRAIN_GPUS=2\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHRUN"}
    env.update(QERL=str(venv / "qerl"), PATH=f"{tmp_path}:{os.environ['PATH']}")
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(tmp_path / "run"), "0"],
                   env=env, check=True, capture_output=True)
    assert log.read_text().startswith(f"{'VENV' if beside else 'PATH'} --nproc-per-node 2 -m qerl_cli train-step ")


def test_train_extra_is_word_split_and_optional(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _stage(tmp_path / "a", "train", 0, extra='TRAIN_EXTRA=""').endswith("metrics.jsonl")
    assert _stage(tmp_path / "b", "train", 0, extra='TRAIN_EXTRA="--lora-dropout 0.05"').endswith("--lora-dropout 0.05")


def test_slurm_bf16_baseline_uses_the_model_dir_and_skips_quantize(tmp_path):
    (tmp_path / "qerl.log").write_text("")
    assert _stage(tmp_path, "quantize", 0, "BASE_FORMAT=bf16") == ""
    assert _stage(tmp_path, "rollout", 0, "BASE_FORMAT=bf16").startswith("rollout --model /models/Qwen2.5-7B-Instruct ")


def test_slurm_final_fp4_merge_requantizes_and_scores_the_merged_policy(tmp_path):
    # As grpo.sh: an NVFP4 merge adds the update to the bf16 source, and both policies are scored alike
    # (the base by its own job, the eval stage with STEP -1, which the final job depends on).
    run, model = tmp_path / "run", "/models/Qwen2.5-7B-Instruct"
    log = _stage(tmp_path, "final", 0, "MERGE_DTYPE=nvfp4\nEVAL_DATASET=t.jsonl\nEVAL_MAX_PROBLEMS=50")
    cmds = [c.strip() for c in log.split("--device cuda")]  # the prompt template holds newlines
    assert cmds[0].startswith(f"merge --model {run}/base --adapter {run}/step-000004/adapter --out {run}/merged")
    assert f"--dtype nvfp4 --requantize-from {model}" in cmds[0]
    assert f"eval --model {run}/merged --dataset t.jsonl" in cmds[0] and "eval-base" not in cmds[0]
    assert [c.count("--max-problems 50") for c in cmds] == [0, 1]
    assert log.endswith(f"eval --compare {run}/eval-base {run}/eval-final")
    (tmp_path / "b").mkdir()
    assert "--requantize-from" not in _stage(tmp_path / "b", "final", 0)  # a bf16 merge needs no source


def test_slurm_eval_stage_scores_the_base_or_a_steps_adapter(tmp_path):
    run = tmp_path / "run"
    base = _stage(tmp_path, "eval", -1, "EVAL_DATASET=t.jsonl")
    assert base.startswith(f"eval --model {run}/base --dataset t.jsonl ") and base.endswith(f"--out {run}/eval-base")
    (tmp_path / "b").mkdir()
    run = tmp_path / "b" / "run"
    step = _stage(tmp_path / "b", "eval", 2, "EVAL_DATASET=t.jsonl")
    assert step.startswith(f"eval --model {run}/base --adapter {run}/step-000002/adapter --dataset t.jsonl ")
    assert step.endswith(f"--out {run}/step-000002/eval")


# How long a test waits for an event it needs (a stage logging itself, a script ending, its processes gone) before it
# fails. Generous on purpose: a loaded machine (CI's 2 cores shared with other jobs) is slower, not wrong. Fixed
# waits (400 polls of 0.05 s, `sleep 1`) sent the signal before quickstart.sh had reached its first stage there,
# and the tests failed.
PATIENCE = 180


def _wait_for(event, what: str):
    """Poll ``event()`` until it is true and return its value; fail the test after PATIENCE s, naming ``what``."""
    end = time.monotonic() + PATIENCE
    while not (value := event()):
        if time.monotonic() > end:
            pytest.fail(f"waited {PATIENCE} s for {what}")
        time.sleep(0.05)
    return value


def _logged(log: Path, text: str = "") -> bool:
    """Whether ``log`` has a line yet (and ``text`` in it)."""
    return log.exists() and bool(log.read_text().strip()) and text in log.read_text()


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid``: a script started with start_new_session=True and every process it
    started, process groups of their own included (zombies left out: a container's PID 1 may never reap them)."""
    pids = []
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, _, _, session = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[:4]
            if int(session) == sid and state not in "ZX":
                pids.append(int(d))
    return pids


def _session_ends(p: subprocess.Popen) -> None:
    """Wait until the session ``p`` leads is empty: then nothing of the run can start anything more, where a fixed
    `sleep` only gave an orphaned loop a while to show itself. Any process still there after PATIENCE s is
    killed (this test started it) and the test fails."""
    try:
        _wait_for(lambda: not _session(p.pid), f"every process started by {p.args} to end")
    finally:
        for pid in _session(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def _signal_recorder(tmp_path, extra: str = ""):
    """A stand-in stage that logs "STAGE PID{extra}", then the TERM or INT it gets (exiting 143 / 130 as qerl does),
    or "not signalled" after PATIENCE s (wall-clock: a count of `sleep 0.05` is no time bound on a loaded machine)."""
    log = tmp_path / "qerl.log"
    body = (f'echo "$1 $${extra}" >> {log}\n'
            f"trap 'echo \"$1 got TERM\" >> {log}; exit 143' TERM\n"
            f"trap 'echo \"$1 got INT\" >> {log}; exit 130' INT\n"
            f'while [ "$SECONDS" -lt {PATIENCE} ]; do sleep 0.05; done; echo "$1 not signalled" >> {log}\n')
    return _recorder(tmp_path, "qerl", body), log


def _signal_once_started(cmd, env, log, sig) -> int:
    """Start ``cmd`` as from a terminal (SIGINT not ignored) in a session of its own, send ``sig`` to it alone (not
    its process group) once the first stage has logged itself, and return its exit status once every process it
    started has ended."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: _logged(log), "the first stage to log itself")
        p.send_signal(sig)
        return p.wait(timeout=PATIENCE)
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.kill()  # a script still running after a failed wait
        p.wait()
        _session_ends(p)  # an orphaned loop or stage would still run


def _argv_recorder(tmp_path):
    """A stand-in qerl that logs each call's arguments, one call a line (shell-quoted, newlines escaped)."""
    log = tmp_path / "qerl.log"
    return _recorder(tmp_path, "qerl", f'printf "%q " "$@" >> {log}; echo >> {log}\n'), log


@pytest.mark.parametrize("config, settings", [(c, {}) for c in CONFIGS] + [
    (RECIPES / "configs" / "tiny.env", {"BASE_FORMAT": "bf16", "TRAIN_EXTRA": "--keep-activations 2 --deterministic"}),
    (RECIPES / "configs" / "tiny.env", {"PROMPT_KEY": "prompt", "ANSWER_KEY": "answer"}),
    (RECIPES / "configs" / "tiny.env", {"SYSTEM_PROMPT": "Think step by step.", "STOP": "\nQ:"}),
], ids=lambda x: x.name if isinstance(x, Path) else ",".join(x) or "-")
def test_every_command_a_config_makes_the_recipes_run_parses_and_passes_the_flag_checks(tmp_path, config, settings,
                                                                                        doc_stand_ins):
    # The recorded commands were compared with one another (above, below), never with the stages' flags: a
    # config's TRAIN_EXTRA, or a flag lib.sh writes, that a stage renamed failed only on the cluster. Each command
    # grpo.sh runs (stage.sbatch runs the same ones) must reach its first input, as the pages' commands must, and
    # then, given stand-ins of its inputs, its work (the checks against the inputs passed too).
    from tests.test_docs import (
        assert_reaches_the_input_check,
        assert_reaches_the_work,
        on_missing_inputs,
        shell_words,
    )

    qerl, log = _argv_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "STEPS": "2", "WARMUP_STEPS": "0", "EVAL_EVERY": "1", "MERGE_DTYPE": "nvfp4",
           "CHAT_TEMPLATE_FILE": "/t/chat.jinja", "CHAT_TEMPLATE_KWARGS": '{"enable_thinking": false}',
           "DEVICE": "cpu", **settings}  # quantize asks for the GPU a Qwen config names before it looks for the model
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(config), str(tmp_path / "run")], env=env, check=True,
                   capture_output=True)
    ran = [shell_words(line) for line in log.read_text().splitlines()]
    assert {"rollout", "train-step", "merge", "eval"} <= {words[0] for words in ran}  # quantize too, on an nvfp4 base
    missing, out = tmp_path / "not-there", tmp_path / "out"
    for words in ran:
        args = on_missing_inputs(words[0], words[1:], missing, out)
        assert args is not None, words
        assert_reaches_the_input_check(args, missing, f"{config.name} {settings}")
        assert_reaches_the_work(args, missing, doc_stand_ins, f"{config.name} {settings}")


def test_the_local_loop_and_the_slurm_stages_run_the_same_commands(tmp_path):
    # The two scripts kept a copy each of every stage's flags, and stage.sbatch lost --chat-template-file
    # (rollout and eval). Both now build them in recipes/lib.sh: the same config gives the same commands,
    # but for where the shards go.
    extra = ("WARMUP_STEPS=0\nSTEPS=2\nEVAL_EVERY=1\nEVAL_MAX_PROBLEMS=9\nCHAT_TEMPLATE_FILE=/t/chat.jinja\nMERGE_DTYPE=nvfp4\n"
             "DTYPE=bf16\nRUN_SEED=5\nEVAL_DATASET=t.jsonl\nCHAT_TEMPLATE_KWARGS='{\"enable_thinking\": false}'\n")
    cfg = _qwen_cfg(tmp_path, extra)
    run = tmp_path / "run"
    qerl, log = _argv_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "SLURM_ARRAY_TASK_ID": "0"}
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, check=True, capture_output=True)
    local = log.read_text().splitlines()
    log.write_text("")
    for stage, step in [("quantize", 0), ("eval", -1), ("rollout", 0), ("train", 0), ("eval", 0), ("rollout", 1),
                        ("train", 1), ("final", 0)]:
        subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), str(step)],
                       env=env, check=True, capture_output=True)
    slurm = [c.replace(" --shard-index 0 --num-shards 1", "").replace("/shards-0 ", "/shards ")
             for c in log.read_text().splitlines()]
    assert slurm == local
    assert sum("--chat-template-file /t/chat.jinja" in c for c in local) == 6  # 2 rollouts, 3 evals, the merge
    kwargs = subprocess.run(["bash", "-c", 'printf %q "$1"', "_", '{"enable_thinking": false}'], capture_output=True,
                            text=True, check=True).stdout  # as the recorder logs it: one argument, quotes kept
    assert sum(f"--chat-template-kwargs {kwargs} " in c for c in local) == 5
    assert sum("--run-seed 5 " in c for c in local) == 2 and all("--dtype bf16 " in c for c in local[1:-3])


def _recipe_commands(tmp_path, cfg, slurm_stages) -> tuple[list[str], list[str]]:
    """The qerl command lines grpo.sh runs on ``cfg`` into tmp_path/run, and those the Slurm jobs ``slurm_stages``
    (stage.sbatch's first argument, step 1) run after it."""
    qerl, log = _argv_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "SLURM_ARRAY_TASK_ID": "0"}
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env, check=True,
                   capture_output=True)
    local = log.read_text().splitlines()
    log.write_text("")
    for stage in slurm_stages:
        subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(tmp_path / "run"), "1"],
                       env=env, check=True, capture_output=True)
    return local, log.read_text().splitlines()


def test_a_datasets_own_column_names_reach_every_rollout_and_eval(tmp_path):
    # a chat set keeping its reference in `final_answer` could not be run by the recipes: they passed no --answer-key
    # (nor --prompt-key), so eval refused every row, "row has no `answer`", and gsm8k-rewarded rollouts too
    cfg = _qwen_cfg(tmp_path, "WARMUP_STEPS=0\nSTEPS=2\nEVAL_EVERY=1\nEVAL_DATASET=t.jsonl\n"
                              "PROMPT_KEY=conversation\nANSWER_KEY=meta.final_answer\n")
    local, chain = _recipe_commands(tmp_path, cfg, ("rollout",))
    for c in local + chain:
        stage = c.split()[0]
        named = "--prompt-key conversation " in c and "--answer-key meta.final_answer " in c
        assert named == (stage in ("rollout", "eval") and "--compare" not in c), c
    assert sum(c.startswith(("rollout", "eval ")) for c in local) == 2 + 4  # evals: the base, step 0, final, --compare


def test_the_system_prompt_and_stop_reach_every_rollout_and_eval_and_the_template_the_merge(tmp_path):
    # grpo.sh and the Slurm jobs had no knob for --system-prompt or --stop (a base model's few-shot stop, $'\nQ:'):
    # such a run needed a copy of the recipes. And the merged checkpoint lacked CHAT_TEMPLATE_FILE's template, which
    # its tokenizer needs to prompt as the policy was trained (apply_chat_template failed on a base model's).
    cfg = _qwen_cfg(tmp_path, "WARMUP_STEPS=0\nSTEPS=2\nEVAL_EVERY=1\nEVAL_DATASET=t.jsonl\nCHAT_TEMPLATE_FILE=/t/c.jinja\n"
                              "SYSTEM_PROMPT='Think step by step.'\nSTOP=$'\\nQ:'\n")
    local, chain = _recipe_commands(tmp_path, cfg, ("rollout", "final"))
    for c in local + chain:
        stage = c.split()[0]
        named = "--system-prompt Think\\ step\\ by\\ step. " in c and "--stop $'\\nQ:' " in c
        assert named == (stage in ("rollout", "eval") and "--compare" not in c), c
        assert ("--chat-template-file /t/c.jinja " in c) == (stage in ("rollout", "eval", "merge") and "--compare" not in c), c
    assert sum(c.startswith(("rollout", "eval ", "merge")) for c in local) == 2 + 4 + 1
    assert sum(c.startswith("merge") for c in chain) == 1


def _json_argv_recorder(tmp_path):
    """A stand-in qerl that logs each call's arguments as one JSON list a line (a stop's newline kept as it is)."""
    log = tmp_path / "qerl.jsonl"
    qerl = tmp_path / "qerl"
    qerl.write_text(f"#!{sys.executable}\nimport json, sys\nwith open({str(log)!r}, 'a') as f:\n"
                    "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    qerl.chmod(0o755)
    return qerl, log


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_an_eval_set_with_other_columns_than_the_train_set_gets_its_own(tmp_path):
    # One PROMPT_KEY / ANSWER_KEY reached rollout and eval alike: a set of one's own (question / solution) trained on
    # beside the bundled or a GSM8K-style test set (prompt / answer) could not be run, eval refusing every row of it
    # ("row has no `question` (named by --prompt-key ...)"; session 59's list). EVAL_PROMPT_KEY / EVAL_ANSWER_KEY name
    # the eval set's; unset, they are the train set's (test_a_datasets_own_column_names_reach_every_rollout_and_eval)
    cfg = _qwen_cfg(tmp_path, "WARMUP_STEPS=0\nSTEPS=2\nEVAL_EVERY=1\nEVAL_DATASET=t.jsonl\nPROMPT_KEY=question\n"
                              "ANSWER_KEY=solution\nEVAL_PROMPT_KEY=prompt\nEVAL_ANSWER_KEY=final.answer\n")
    local, chain = _recipe_commands(tmp_path, cfg, ("rollout", "eval", "final"))
    for c in local + chain:
        stage = c.split()[0]
        assert ("--prompt-key question --answer-key solution " in c) == (stage == "rollout"), c
        assert ("--prompt-key prompt --answer-key final.answer " in c) == (stage == "eval" and "--compare" not in c), c
    assert sum(c.startswith(("rollout", "eval ")) for c in local + chain) == 2 + 4 + 4  # each eval-final, a --compare
    # the chain's jobs take them from submit.env, the train set's where the eval set's are not set
    for extra, want in (({"EVAL_PROMPT_KEY": "prompt"}, ("prompt", "solution")), ({}, ("question", "solution"))):
        sbatch, _ = _fake_sbatch(tmp_path)
        subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(_qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\n")),
                        str(tmp_path / "chain")], check=True, capture_output=True,
                       env={**os.environ, "SBATCH": str(sbatch), "PROMPT_KEY": "question", "ANSWER_KEY": "solution",
                            **extra})
        lines = (tmp_path / "chain" / "submit.env").read_text().splitlines()
        assert [x for x in lines if x.startswith("EVAL_PROMPT_KEY=")] == [f"EVAL_PROMPT_KEY={want[0]}"]
        assert [x for x in lines if x.startswith("EVAL_ANSWER_KEY=")] == [f"EVAL_ANSWER_KEY={want[1]}"]


def _loop_and_chain(tmp_path, cfg, env) -> tuple:
    """grpo.sh run on ``cfg`` into tmp_path/run, then a Slurm chain of it submitted into tmp_path/chain (its jobs are
    the caller's to run): (run, chain)."""
    run, chain = tmp_path / "run", tmp_path / "chain"
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, check=True, capture_output=True)
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(chain)], env=env, check=True,
                   capture_output=True)
    return run, chain


def test_an_eval_key_set_empty_leaves_eval_its_own_columns_in_the_loop_and_the_chain(tmp_path):
    # EVAL_PROMPT_KEY=${EVAL_PROMPT_KEY:-$PROMPT_KEY}: once PROMPT_KEY was set, eval could not go back to its own
    # columns (prompt, messages, question, problem; answer), an empty value read as unset (session 60's list). Set
    # empty, eval gets no --prompt-key; submit.env keeps it empty, not unset, for the chain's jobs
    import json

    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\nEVAL_DATASET=t.jsonl\nPROMPT_KEY=question\nANSWER_KEY=solution\n")
    qerl, log = _json_argv_recorder(tmp_path)
    sbatch, _ = _fake_sbatch(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if k != "EVAL_ANSWER_KEY"}, "QERL": str(qerl), "SBATCH": str(sbatch),
           "EVAL_PROMPT_KEY": ""}
    run, chain = _loop_and_chain(tmp_path, cfg, env)
    assert {"EVAL_PROMPT_KEY=''", "EVAL_ANSWER_KEY=solution"} <= set((chain / "submit.env").read_text().splitlines())
    del env["EVAL_PROMPT_KEY"]  # the job's environment need not hold it
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "eval", str(cfg), str(chain), "0"], env=env,
                   check=True, capture_output=True)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    evals = [c for c in calls if c[0] == "eval" and "--compare" not in c]
    assert len(evals) == 2 + 1  # grpo.sh: the base, the final; the chain's eval job
    assert all("--prompt-key" not in c and _flag_values(c, "--answer-key") == ["solution"] for c in evals), evals
    assert all(_flag_values(c, "--prompt-key") == ["question"] for c in calls if c[0] == "rollout")


@pytest.mark.parametrize("stops", [["\nQ:"], ["\nQ:", "</answer> it's \"done\"\n"]], ids=["one", "two"])
def test_one_or_several_stops_reach_every_rollout_and_eval_of_the_loop_and_the_chain(tmp_path, stops):
    # STOP held one string: several (a base model's few-shot "\nQ:" and an answer tag) could not be passed, and a
    # config's STOP=(...) array passed its first alone, the others dropped without a word (session 59's list). Each
    # element of the array is one --stop, in grpo.sh and in every job of a chain (through submit.env: the jobs below
    # run with a config that no longer sets STOP)
    import shlex

    stop = f"STOP={shlex.quote(stops[0])}\n" if len(stops) == 1 else f"STOP=({' '.join(map(shlex.quote, stops))})\n"
    settings = "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_EVERY=1\nEVAL_DATASET=t.jsonl\n"
    cfg = _qwen_cfg(tmp_path, settings + stop)
    qerl, log = _json_argv_recorder(tmp_path)
    sbatch, _ = _fake_sbatch(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch), "SLURM_ARRAY_TASK_ID": "0"}
    run, chain = _loop_and_chain(tmp_path, cfg, env)
    cfg.write_text(cfg.read_text().replace(stop, ""))
    for stage, step in (("rollout", "1"), ("eval", "0"), ("final", "")):
        subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(chain), step], env=env,
                       check=True, capture_output=True)
    import json

    calls = [json.loads(x) for x in log.read_text().splitlines()]
    sampled = [c for c in calls if c[0] in ("rollout", "eval") and "--compare" not in c]
    assert len(sampled) == 2 + 3 + 1 + 2  # grpo.sh: 2 rollouts, 3 evals; the jobs: a rollout, two evals
    assert all(_flag_values(c, "--stop") == stops for c in sampled), sampled
    assert not any("--stop" in c for c in calls if c not in sampled)


@pytest.mark.parametrize("setting, rewards", [
    ("REWARDS='gsm8k format=0.5'", ["gsm8k", "format=0.5"]),  # names word-split, as before
    ("REWARDS=(gsm8k 'format=0.5' 'my rewards.py:judge')", ["gsm8k", "format=0.5", "my rewards.py:judge"]),
], ids=["words", "array"])
def test_a_config_s_rewards_reach_every_rollout_of_the_loop_and_the_chain(tmp_path, setting, rewards):
    # REWARDS was word-split alone (`for r in $REWARDS`): a config's REWARDS=(a b) array passed its first reward, the
    # others dropped without a word (session 60's list). Each element is one --reward now, in grpo.sh and in a chain's
    # jobs (through submit.env: the job below runs with a config that no longer sets REWARDS, then with the config's
    # array under an older submit.env's one string, which the job keeps whole)
    import json

    cfg = _qwen_cfg(tmp_path, f"\nWARMUP_STEPS=0\nSTEPS=2\n{setting}\n")
    qerl, log = _json_argv_recorder(tmp_path)
    sbatch, _ = _fake_sbatch(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if k != "REWARDS"}, "QERL": str(qerl), "SBATCH": str(sbatch),
           "SLURM_ARRAY_TASK_ID": "0"}
    run, chain = _loop_and_chain(tmp_path, cfg, env)
    cfg.write_text(cfg.read_text().replace(setting, ""))
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(chain), "1"], env=env,
                   check=True, capture_output=True)
    rollouts = [c for c in map(json.loads, log.read_text().splitlines()) if c[0] == "rollout"]
    assert len(rollouts) == 2 + 1 and all(_flag_values(c, "--reward") == rewards for c in rollouts), rollouts
    submitted = (chain / "submit.env").read_text()
    submitted = "\n".join(x for x in submitted.splitlines() if not x.startswith("REWARDS="))
    (chain / "submit.env").write_text(submitted + "\nREWARDS=gsm8k\n")
    cfg.write_text(cfg.read_text() + f"\n{setting}\n")
    log.write_text("")
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(chain), "1"], env=env,
                   check=True, capture_output=True)
    (argv,) = map(json.loads, log.read_text().splitlines())
    assert _flag_values(argv, "--reward") == ["gsm8k"], argv


def test_a_chain_submitted_without_stops_keeps_none_when_the_config_gets_several(tmp_path):
    # submit.env's values win over CONFIG's (stage.sbatch): its STOP='' assigned the first element of a config's
    # STOP=(...) array alone, so a job passed the config's second stop, one the chain's other jobs never had
    qerl, log = _json_argv_recorder(tmp_path)
    cfg, run = _submit_7b_chain(tmp_path)
    assert "STOP=''" in (run / "submit.env").read_text().splitlines()
    cfg.write_text(cfg.read_text() + "STOP=($'\\nQ:' '</answer>')\n")
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(run), "1"],
                   env={**os.environ, "QERL": str(qerl)}, check=True, capture_output=True)
    import json

    (argv,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert argv[0] == "rollout" and "--stop" not in argv, argv


def _shard_args(log, run):
    """Each rollout's --out and each train-step's --shards in the recorder's log, relative to ``run``."""
    import shlex

    got = []
    for line in log.read_text().splitlines():
        argv = shlex.split(line)
        flag = {"rollout": "--out", "train-step": "--shards"}.get(argv[0])
        got += [(argv[0], argv[i + 1].removeprefix(f"{run}/")) for i, a in enumerate(argv) if a == flag]
    return got


@pytest.mark.parametrize("begun_by", ["grpo.sh", "chain"])
def test_a_run_dir_moves_between_grpo_sh_and_a_one_task_chain(tmp_path, begun_by):
    # grpo.sh writes step-<s>/shards, a chain step-<s>/shards-<i>: a run dir moved between them redid each begun
    # step's rollout under the other name (hours of GPU on a large model; a review, 2026-11-27). One task's shard is
    # the same rollout (shard 0 of 1), so the step goes on in the directory it has, finished or under way.
    qerl, log = _argv_recorder(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_DATASET=\n")
    run = tmp_path / "run dir"
    own, other = ("shards", "shards-0") if begun_by == "grpo.sh" else ("shards-0", "shards")
    (run / "step-000000" / own).mkdir(parents=True)  # step 0 finished, step 1's rollout under way
    (run / "step-000001" / f".{own}.partial-0123456789abcdef").mkdir(parents=True)
    env = {**os.environ, "QERL": str(qerl)}
    if begun_by == "grpo.sh":
        for stage, step in [("rollout", 0), ("train", 0), ("rollout", 1), ("train", 1)]:
            subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), str(step)],
                           env=env, check=True, capture_output=True)
    else:
        subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, check=True, capture_output=True)
    assert _shard_args(log, run) == [("rollout", f"step-00000{s}/{own}") if i == 0 else ("train-step", f"step-00000{s}/{own}")
                                     for s in range(2) for i in range(2)]
    assert not list(run.glob(f"step-*/{other}"))


def _queueing_sbatch(tmp_path):
    """A stand-in sbatch that queues each job (its options, script and arguments, environment and --chdir) as
    JSON, for _run_queue."""
    queue = tmp_path / "queue"
    queue.mkdir()
    body = (f'n=$(( $(ls {queue} | wc -l) + 100 )); python3 -c \'import json, os, sys; json.dump({{"argv": sys.argv[2:], '
            f'"env": dict(os.environ)}}, open(sys.argv[1], "w"))\' {queue}/$n.json "$@"; echo "$n;cluster"\n')
    return _recorder(tmp_path, "sbatch", body), queue


def _run_queue(queue):
    """Run the queued jobs in id order as Slurm would on one node: afterok (a failed dependency cancels), --array
    tasks with SLURM_ARRAY_TASK_ID, in --chdir, each script run from a copy (Slurm's spool). {job name: status}."""
    import json as _json

    done, status = {}, {}
    for f in sorted(queue.glob("*.json"), key=lambda p: int(p.stem)):
        job = _json.loads(f.read_text())
        argv, opts = job["argv"], {}
        while argv[0].startswith("--"):
            key, _, value = argv[0].partition("=")
            if value or key in ("--parsable", "--kill-on-invalid-dep"):
                opts[key], argv = value, argv[1:]
            else:
                opts[key], argv = argv[1], argv[2:]
        deps = opts["--dependency"].split(":")[1:] if "--dependency" in opts else []
        spool = queue / f"{f.stem}.sbatch"
        shutil.copy(argv[0], spool)
        ok = all(done.get(d) for d in deps)
        lo, _, hi = opts.get("--array", "").partition("-")
        for task in range(int(lo), int(hi) + 1) if lo else [None]:
            if not ok:
                break
            env = {**job["env"], "SLURM_JOB_ID": f.stem,
                   **({} if task is None else {"SLURM_ARRAY_JOB_ID": f.stem, "SLURM_ARRAY_TASK_ID": str(task)})}
            r = subprocess.run(["bash", str(spool), *argv[1:]], cwd=opts["--chdir"], env=env, capture_output=True,
                               text=True)
            ok = r.returncode == 0
            status[opts["--job-name"] + ("" if task is None else f"_{task}")] = r.stdout + r.stderr
        done[f.stem] = ok
        if not ok:
            status[opts["--job-name"]] = status.get(opts["--job-name"], "") + "FAILED or CANCELLED"
    return done, status


@pytest.mark.slow
def test_a_chain_runs_on_the_tiny_model_and_grpo_sh_continues_it(tmp_path):
    # The whole Slurm path on the bundled tiny model on CPU, through a stand-in sbatch whose jobs run here in
    # dependency order (a path with a space included): a resubmission says "already done", and grpo.sh on the
    # chain's run dir goes on in its shards-0 directories: it rolled the last step out again (a review, 2026-11-27).
    sbatch, queue = _queueing_sbatch(tmp_path)
    run = tmp_path / "run dir"
    env = {**os.environ, "SBATCH": str(sbatch), "GPU_GRES": "", "QERL": f"{sys.executable} -m qerl_cli", "STEPS": "2",
           "PROMPTS_PER_STEP": "4", "NUM_GENERATIONS": "4", "MAX_NEW_TOKENS": "16", "EVAL_MAX_PROBLEMS": "4",
           "EVAL_EVERY": "1", "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(RECIPES / "slurm" / "submit.sh"), str(RECIPES / "configs" / "tiny.env"), str(run)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tmp_path)
    done, logs = _run_queue(queue)
    assert all(done.values()), logs
    assert sorted(p.relative_to(run).as_posix() for p in run.glob("step-*/*")) == [
        "step-000000/adapter", "step-000000/eval", "step-000000/shards-0", "step-000001/adapter", "step-000001/shards-0"]
    assert (run / "eval-final" / "manifest.json").exists()
    for f in queue.glob("*"):
        f.unlink()
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tmp_path)  # resubmitted
    done, logs = _run_queue(queue)
    assert all(done.values()) and all("already done" in log for log in logs.values()), logs
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(RECIPES / "configs" / "tiny.env"), str(run)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "wrote" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert not list(run.glob("step-*/shards"))


def _on_step_0_holding(tmp_path, script, dirs, settings):
    """grpo.sh or a 2-task submit.sh (recorded qerl and sbatch) on a run dir whose step 0 holds ``dirs``:
    (the run, qerl's argv log, sbatch's log, the run dir)."""
    qerl, log = _argv_recorder(tmp_path)
    sbatch, sbatch_log = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, f"\nWARMUP_STEPS=0\n{settings}\n")
    run = tmp_path / "run"
    for d in dirs:
        (run / "step-000000" / d).mkdir(parents=True)
    argv = [RECIPES / "grpo.sh"] if script == "grpo.sh" else [RECIPES / "slurm" / "submit.sh"]
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch), "ROLLOUT_SHARDS": "2"}
    r = subprocess.run(["bash", *map(str, argv), str(cfg), str(run)], env=env, capture_output=True, text=True)
    return r, log, sbatch_log, run


@pytest.mark.parametrize("script", ["grpo.sh", "submit.sh"])
def test_a_run_dir_the_other_script_began_with_another_shard_count_is_refused_first(tmp_path, script):
    # grpo.sh on a chain's step of 2 shards rolled the step out again as one shard, then refused at its train-step
    # with "input shards changed ... pass --force", and again at step 0 after a second rollout; FORCE=1 redid the run
    # (a review, 2026-11-27). A chain of 2 tasks on grpo.sh's steps failed at its first train job the same way.
    r, log, sbatch_log, _ = _on_step_0_holding(tmp_path, script, ["shards-0", "shards-1"] if script == "grpo.sh"
                                               else ["shards"], "STEPS=3")
    assert r.returncode == 2 and not log.exists() and not sbatch_log.exists(), r.stderr
    want = {"grpo.sh": "error: step-000000 holds a Slurm chain's rollout in 2 shards (step-000000/shards-<i>): "
                       "continue this run with recipes/slurm/submit.sh and ROLLOUT_SHARDS=2",
            "submit.sh": "error: step-000000 holds grpo.sh's rollout (one shard, step-000000/shards): continue this run "
                         "with grpo.sh, or with ROLLOUT_SHARDS=1"}[script]
    assert want in r.stderr, r.stderr


@pytest.mark.parametrize("script", ["grpo.sh", "submit.sh"])
def test_a_step_both_scripts_rolled_out_goes_on_with_the_callers_own(tmp_path, script):
    # Before 2026-11-27 each script rolled a step the other began out again under its own name: such a step holds
    # both layouts, and each script refused it naming the other (grpo.sh: "continue with submit.sh"; a chain of 2
    # tasks: "continue with grpo.sh"), where each had read its own.
    r, log, sbatch_log, run = _on_step_0_holding(tmp_path, script, ["shards", "shards-0", "shards-1"],
                                                 "STEPS=2\nEVAL_DATASET=")
    assert r.returncode == 0, r.stderr
    if script == "grpo.sh":
        assert _shard_args(log, run)[:2] == [("rollout", "step-000000/shards"), ("train-step", "step-000000/shards")]
    else:
        assert "qerl-train-1" in sbatch_log.read_text()


@pytest.mark.parametrize("where", ["shards-0", ".shards-0.partial-0123456789abcdef"])
def test_grpo_sh_refuses_a_chains_shard_0_of_several_alone(tmp_path, where):
    # A chain of 2 tasks whose task 1 failed or was cancelled before it wrote leaves shard 0 of 2 alone: grpo.sh took
    # it for a one-task chain's shard, and its rollout into it refused (exit 4: "holds shard 0 of 2"); FORCE=1 deleted it.
    qerl, log = _argv_recorder(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\n")
    run = tmp_path / "run"
    (run / "step-000000" / where).mkdir(parents=True)
    (run / "step-000000" / where / "shard-00000-of-00002.jsonl").write_text("{}\n")
    env = {**os.environ, "QERL": str(qerl), "FORCE": "1"}
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and not log.exists(), r.stderr
    assert "error: step-000000 holds a Slurm chain's rollout in 2 shards" in r.stderr
    # shard 0 of 1 (a one-task chain's) is continued as before
    (run / "step-000000" / where / "shard-00000-of-00002.jsonl").rename(run / "step-000000" / where / "shard-00000-of-00001.jsonl")
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _shard_args(log, run)[0] == ("rollout", "step-000000/shards-0")


def _submit_on_step_0_holding(tmp_path, files, shards, force="0"):
    """submit.sh with ROLLOUT_SHARDS=``shards`` (a fake sbatch) on a run dir whose step 0 holds ``files`` (a name
    ending in / a directory): (the result, whether any job was queued)."""
    sbatch, sbatch_log = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=3\nEVAL_DATASET=\n")
    run = tmp_path / "run"
    for f in files:
        (run / "step-000000" / f).parent.mkdir(parents=True, exist_ok=True)
        if f.endswith("/"):
            (run / "step-000000" / f).mkdir(exist_ok=True)
        else:
            (run / "step-000000" / f).write_text("{}\n")
    env = {**os.environ, "SBATCH": str(sbatch), "ROLLOUT_SHARDS": str(shards), "FORCE": force}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(run)], env=env, capture_output=True,
                       text=True)
    return r, sbatch_log.exists()


@pytest.mark.parametrize("files, shards, want", [
    # a one-task chain on a two-task chain's step: its rollout task refused (exit 4, "holds shard 0 of 2"), and with
    # FORCE=1 deleted that shard
    (["shards-0/shard-00000-of-00002.jsonl", "shards-1/shard-00001-of-00002.jsonl"], 1,
     "step-000000 holds a Slurm chain's rollout in 2 shards (step-000000/shards-<i>), not ROLLOUT_SHARDS=1: continue "
     "this run with ROLLOUT_SHARDS=2"),
    (["shards-0/", "shards-1/"], 1, "in 2 shards (step-000000/shards-<i>), not ROLLOUT_SHARDS=1"),
    (["shards-0/shard-00000-of-00002.jsonl"], 1, "in 2 shards"),  # its other task wrote nothing
    # a two-task chain on a step grpo.sh and a one-task chain both rolled out, or the one-task chain alone
    (["shards/shard-00000-of-00001.jsonl", "shards-0/shard-00000-of-00001.jsonl"], 2,
     "step-000000 holds a one-shard rollout (step-000000/shards-0, a one-task chain's, and step-000000/shards, "
     "grpo.sh's), not 2 shards: continue this run with ROLLOUT_SHARDS=1, or with grpo.sh"),
    ([".shards-0.partial-0123456789abcdef/shard-00000-of-00001.jsonl"], 2, "a one-task chain's), not 2 shards"),
    # a chain of another count: its first tasks refused, the others rolled out shards of the new count beside them
    (["shards-0/shard-00000-of-00002.jsonl", "shards-1/"], 4, "in 2 shards (step-000000/shards-<i>), not ROLLOUT_SHARDS=4"),
    (["shards-0/", "shards-1/", "shards-2/"], 2, "in 3 shards (step-000000/shards-<i>), not ROLLOUT_SHARDS=2"),
])
@pytest.mark.parametrize("force", ["0", "1"])
def test_a_chain_on_a_step_of_another_shard_count_is_refused_before_any_job(tmp_path, files, shards, want, force):
    r, queued = _submit_on_step_0_holding(tmp_path, files, shards, force)
    assert r.returncode == 2 and not queued, r.stderr
    assert r.stderr.startswith("error: step-000000 holds ") and want in r.stderr, r.stderr


@pytest.mark.parametrize("files, shards", [
    # the same chain resubmitted on its half-done step: tasks that wrote nothing yet (or never ran) leave no directory
    (["shards-0/shard-00000-of-00002.jsonl", "shards-1/shard-00001-of-00002.jsonl"], 2),
    ([".shards-1.partial-0123456789abcdef/shard-00001-of-00004.jsonl"], 4),
    (["shards-0/", "shards-1/"], 4),
    (["shards-0/"], 2),
    (["shards-0/shard-00000-of-00001.jsonl"], 1),
    (["shards/shard-00000-of-00001.jsonl"], 1),  # grpo.sh's: the same rollout as one task's
    # a step both scripts rolled out: each goes on with the rollout of its own count
    (["shards/shard-00000-of-00001.jsonl", "shards-0/shard-00000-of-00002.jsonl", "shards-1/"], 1),
    (["shards/shard-00000-of-00001.jsonl", "shards-0/shard-00000-of-00002.jsonl", "shards-1/"], 2),
    (["shards/shard-00000-of-00001.jsonl", "shards-1/shard-00001-of-00002.jsonl"], 2),  # its task 0 wrote nothing yet
])
def test_a_chain_resubmitted_on_its_own_half_done_step_is_queued(tmp_path, files, shards):
    r, queued = _submit_on_step_0_holding(tmp_path, files, shards)
    assert r.returncode == 0 and queued, r.stderr


def test_a_one_task_job_on_a_step_both_scripts_rolled_out_reads_grpo_shs_one_shard(tmp_path):
    # beside a two-task chain's shards, grpo.sh's step-<s>/shards is the step's rollout of one shard (a one-task
    # chain's shards-0 there is the other chain's shard 0 of 2)
    qerl, log = _argv_recorder(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_DATASET=\n")
    run = tmp_path / "run"
    for d, f in [("shards", "shard-00000-of-00001.jsonl"), ("shards-0", "shard-00000-of-00002.jsonl"),
                 ("shards-1", "shard-00001-of-00002.jsonl")]:
        (run / "step-000000" / d).mkdir(parents=True)
        (run / "step-000000" / d / f).write_text("{}\n")
    env = {**os.environ, "QERL": str(qerl), "ROLLOUT_SHARDS": "1"}
    for stage in ("rollout", "train"):
        subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), "0"], env=env,
                       check=True, capture_output=True)
    assert _shard_args(log, run) == [("rollout", "step-000000/shards"), ("train-step", "step-000000/shards")]


def test_a_run_dir_named_with_glob_characters_is_read_as_it_is(tmp_path):
    # The step directories were looked up with `compgen -G "$RUN_DIR/..."`: "run[1]" read as a pattern matched the
    # sibling run1 (a chain's several shards: refused) and missed its own one-task chain's shards-0 (rolled out again).
    qerl, log = _argv_recorder(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_DATASET=\n")
    (tmp_path / "run1" / "step-000000" / "shards-1").mkdir(parents=True)
    run = tmp_path / "run[1]"
    (run / "step-000000" / "shards-0").mkdir(parents=True)
    env = {**os.environ, "QERL": str(qerl)}
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _shard_args(log, run)[:2] == [("rollout", "step-000000/shards-0"), ("train-step", "step-000000/shards-0")]


def _rollouts_shuffled(log):
    """Whether each rollout in the recorder's log passed --shuffle."""
    return [" --shuffle " in line + " " for line in log.read_text().splitlines() if line.startswith("rollout ")]


def _rollout_made(step_dir, shuffle=None):
    """A finished rollout's manifest in ``step_dir`` (config.shuffle as given; None: none recorded, older qerl)."""
    import json as _json

    step_dir.mkdir(parents=True)
    config = {"step": 0} if shuffle is None else {"step": 0, "shuffle": shuffle}
    (step_dir / "manifest.json").write_text(_json.dumps({"stage": "rollout", "config": config, "inputs": {}}))


@pytest.mark.parametrize("shuffle, want", [(None, True), ("auto", True), ("1", True), ("0", False)])
def test_a_new_run_dir_reshuffles_the_prompts_each_epoch_unless_told_not_to(tmp_path, shuffle, want):
    # The recipes never passed rollout --shuffle: a 500-step run at 32 prompts a step went over GSM8K twice in the same
    # order, where the reference trainer reshuffles each epoch (a review, session 58). grpo.sh and the chain alike.
    qerl, log = _argv_recorder(tmp_path)
    sbatch, _ = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_DATASET=\n")
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch), **({} if shuffle is None else {"SHUFFLE": shuffle})}
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env, check=True,
                   capture_output=True)
    assert _rollouts_shuffled(log) == [want, want]
    assert (tmp_path / "run" / "shuffle").read_text() == f"{int(want)}\n"  # for a rerun that finds step 0 under way
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "chain")], env=env,
                   check=True, capture_output=True)
    assert f"\nSHUFFLE={int(want)}\n" in (tmp_path / "chain" / "submit.env").read_text()
    log.unlink()
    job_env = {**os.environ, "QERL": str(qerl), "SHUFFLE": "auto"}  # the job takes the chain's value (submit.env)
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(tmp_path / "chain"), "1"],
                   env=job_env, check=True, capture_output=True)
    assert _rollouts_shuffled(log) == [want]


@pytest.mark.parametrize("script, begun", [(script, begun) for script in ("grpo.sh", "submit.sh") for begun in (
    # a finished step-0 rollout, grpo.sh's or a one-task chain's, made without --shuffle (or by qerl before the flag)
    {"step-000000/shards": False}, {"step-000000/shards-0": None},
    # step 0's directory pruned to free space: the first step that has a rollout
    {"step-000003/shards": False},
    # a rollout under way, begun by the recipes before the knob (no RUN_DIR/shuffle)
    {"step-000000/.shards.partial-0123456789abcdef": "dir"},
)] + [("submit.sh", {"step-000000/shards-0": False, "step-000000/shards-1": None})], ids=str)
def test_a_run_dir_begun_in_file_order_keeps_it(tmp_path, script, begun):
    # --shuffle is in every rollout's fingerprint: turned on in a run dir begun without it, the next rollout refused
    # (exit 4), and FORCE=1 would have redone the run. SHUFFLE=auto keeps such a run as it was begun, and says so.
    qerl, log = _argv_recorder(tmp_path)
    sbatch, _ = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=5\nEVAL_DATASET=\n")
    run = tmp_path / "run"
    for d, shuffle in begun.items():
        if shuffle == "dir":
            (run / d).mkdir(parents=True)
        else:
            _rollout_made(run / d, shuffle)
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch), "ROLLOUT_SHARDS": str(len(begun))}
    cmd = ["bash", str(RECIPES / script if script == "grpo.sh" else RECIPES / "slurm" / script), str(cfg), str(run)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "note: SHUFFLE=auto: " in r.stderr and "made in file order (no --shuffle), so this run keeps" in r.stderr
    shuffled = (lambda: _rollouts_shuffled(log)) if script == "grpo.sh" else (
        lambda: [line == "SHUFFLE=1" for line in (run / "submit.env").read_text().splitlines() if "SHUFFLE=" in line])
    assert shuffled() == ([False] * 5 if script == "grpo.sh" else [False])
    # SHUFFLE=1 is taken as it is (the stage refuses where the run was made otherwise); the run's own choice is kept
    log.write_text("")
    r = subprocess.run(cmd, env={**env, "SHUFFLE": "1"}, capture_output=True, text=True)
    assert r.returncode == 0 and "SHUFFLE=auto" not in r.stderr, r.stderr
    assert shuffled() == ([True] * 5 if script == "grpo.sh" else [True])
    assert not (run / "shuffle").exists()


@pytest.mark.parametrize("script", ["grpo.sh", "stage.sbatch"])
def test_a_rollout_under_way_in_a_new_run_dir_goes_on_shuffled(tmp_path, script):
    # The first rollout stopped (a crash, a pre-emption) leaves step 0 a partial directory, no manifest to read:
    # RUN_DIR/shuffle, written when the run dir was new, keeps its choice (else it read as a run begun before the knob).
    qerl, log = _argv_recorder(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_DATASET=\n")
    run = tmp_path / "run"
    env = {**os.environ, "QERL": str(qerl)}
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, check=True, capture_output=True)
    (run / "step-000000" / ".shards.partial-0123456789abcdef").mkdir(parents=True)
    log.unlink()
    argv = [RECIPES / "grpo.sh", cfg, run] if script == "grpo.sh" else [RECIPES / "slurm" / "stage.sbatch", "rollout",
                                                                         cfg, run, 0]
    r = subprocess.run(["bash", *map(str, argv)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "SHUFFLE=auto" not in r.stderr, r.stderr
    assert set(_rollouts_shuffled(log)) == {True}


@pytest.mark.parametrize("script", ["grpo.sh", "stage.sbatch", "submit.sh"])
@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_a_shuffle_value_other_than_auto_1_or_0_is_refused(tmp_path, script, value):
    # before any stage or job, as the other config values (qerl_load_config): SHUFFLE=yes is not 1
    qerl, log = _argv_recorder(tmp_path)
    sbatch, sbatch_log = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, f"\nWARMUP_STEPS=0\nSTEPS=2\nSHUFFLE={value}\n")
    argv = {"grpo.sh": [RECIPES / "grpo.sh", cfg, tmp_path / "run"],
            "stage.sbatch": [RECIPES / "slurm" / "stage.sbatch", "rollout", cfg, tmp_path / "run", 0],
            "submit.sh": [RECIPES / "slurm" / "submit.sh", cfg, tmp_path / "run"]}[script]
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch)}
    r = subprocess.run(["bash", *map(str, argv)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and f"error: SHUFFLE={value}: use auto, 1 (reshuffle the prompts each epoch) or 0" in r.stderr
    assert not log.exists() and not sbatch_log.exists()


def test_a_run_dir_begun_in_file_order_by_real_qerl_is_already_done(tmp_path):
    # The tiny model through the real stages: a run made without --shuffle (as every run before the knob) is rerun
    # "already done" under SHUFFLE=auto, where SHUFFLE=1 makes its first rollout refuse (exit 4), the flag's change
    # named (a new run dir's rollouts record --shuffle: tests/test_quickstart.py).
    run = tmp_path / "run"
    env = {**os.environ, "QERL": f"{sys.executable} -m qerl_cli", "STEPS": "1", "WARMUP_STEPS": "0",
           "PROMPTS_PER_STEP": "4", "NUM_GENERATIONS": "2", "MAX_NEW_TOKENS": "8", "EVAL_DATASET": "",
           "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(RECIPES / "grpo.sh"), str(RECIPES / "configs" / "tiny.env"), str(run)]
    subprocess.run(cmd, env={**env, "SHUFFLE": "0"}, check=True, capture_output=True)
    (run / "shuffle").unlink()  # as the recipes before the knob left it
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "wrote" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "already done" in r.stdout + r.stderr and "so this run keeps that order" in r.stderr
    r = subprocess.run(cmd, env={**env, "SHUFFLE": "1"}, capture_output=True, text=True)
    assert r.returncode == 4 and "shuffle" in r.stderr, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_grpo_loop_runs_the_stages_in_order_and_reruns_them(tmp_path):
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$1" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nEVAL_DATASET=t.jsonl\n")
    env = {**os.environ, "QERL": str(qerl)}
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env, check=True,
                   capture_output=True)
    stages = log.read_text().split()
    assert stages == ["quantize", "eval", "rollout", "train-step", "rollout", "train-step", "merge", "eval", "eval"]


def _finished_steps(run, n, config=None, break_chain_at=None):
    """Adapter manifests of steps 0..n-1 as train-step writes them: one config, each step's input adapter the
    hash of the step before (recipes/resume_point.py rebuilds it from the file hashes)."""
    import json as _json

    from recipes.resume_point import adapter_inputs_hash

    prev = None
    for st in range(n):
        outputs = {"adapter_config.json": f"c{st}", "adapter_model.safetensors": f"w{st}", "trainer_state.json": f"t{st}"}
        inputs = {"model": "m", "shards": f"s{st}"}
        if prev is not None:
            inputs["adapter"] = "x" if st == break_chain_at else adapter_inputs_hash(prev)
        cfg = {"lr": 3e-5 if st == 0 and config == "mixed" else 1e-5}  # "mixed": step 0 made with another LR
        d = run / f"step-{st:06d}" / "adapter"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(_json.dumps({"stage": "train-step", "config": cfg, "inputs": inputs,
                                                      "outputs": outputs}))
        prev = outputs


def test_the_resume_point_is_the_last_finished_step_of_one_run(tmp_path):
    # Adapters of another config (an interrupted FORCE=1 redo) or a broken chain were skipped over by the first
    # version of the shortcut (a review of it, 2026-11-27): then every step is gone through.
    from recipes.resume_point import resume_point

    for name, kw, want in [("ok", {}, 2), ("mixed", {"config": "mixed"}, 0), ("chain", {"break_chain_at": 1}, 0)]:
        run = tmp_path / name
        _finished_steps(run, 3, **kw)
        assert resume_point(run, 5) == want, name
    assert resume_point(tmp_path / "none", 5) == 0 and resume_point(tmp_path / "ok", 2) == 1


@pytest.mark.parametrize("case", ["resume", "force", "mixed", "refused"])
def test_a_rerun_starts_qerl_from_the_last_finished_step(tmp_path, case):
    # Every finished stage started a qerl process to say "already done", ~2 s each: 35 minutes before a 500-step
    # run went on (a review, 2026-11-27). The last finished step still goes through qerl (its fingerprints check
    # the config and inputs); an eval missing before it runs. FORCE=1, adapters of another run, or a refusal at
    # that step (a changed LoRA rank refuses there with exit 2): every step from step 0, as before.
    import shlex

    qerl, log = _argv_recorder(tmp_path)
    if case == "refused":  # the last finished step's train-step refuses once (its adapter's rank changed)
        qerl.write_text(qerl.read_text().replace('printf', f'[ "$1" = train-step ] && [ ! -e {tmp_path}/once ] && '
                                                          f'touch {tmp_path}/once && exit 2\nprintf', 1))
    cfg = tmp_path / "c.env"
    cfg.write_text((RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text()
                   + "\nWARMUP_STEPS=0\nSTEPS=5\nEVAL_DATASET=t.jsonl\nEVAL_EVERY=2\n")  # evals after steps 1, 3
    run = tmp_path / "run"
    _finished_steps(run, 3, config="mixed" if case == "mixed" else None)  # steps 0-2; step 1's eval is missing
    env = {**os.environ, "QERL": str(qerl)} | ({"FORCE": "1"} if case == "force" else {})
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    steps = []
    for line in log.read_text().splitlines():
        argv = shlex.split(line)
        out = argv[argv.index("--out") + 1].removeprefix(f"{run}/") if "--out" in argv else ""
        if out.startswith("step-"):
            steps.append((argv[0], out))
    tail = [("rollout", "step-000002/shards"), ("train-step", "step-000002/adapter"), ("rollout", "step-000003/shards"),
            ("train-step", "step-000003/adapter"), ("eval", "step-000003/eval"), ("rollout", "step-000004/shards"),
            ("train-step", "step-000004/adapter")]
    walk = [("rollout", "step-000000/shards"), ("train-step", "step-000000/adapter"), ("rollout", "step-000001/shards"),
            ("train-step", "step-000001/adapter"), ("eval", "step-000001/eval")] + tail
    if case == "resume":
        # the checked step's stages run once (they ran twice: the loop started at that step again; a review)
        assert steps == tail[:2] + [("eval", "step-000001/eval")] + tail[2:], steps
    elif case == "refused":  # the refused train-step is not logged (the stand-in exits before it writes)
        assert steps == [tail[0]] + walk, steps
        assert "step 2 refused (above): going through every step from step 0" in r.stdout
    else:
        assert steps == walk, steps


def _host_without_python(tmp_path) -> str:
    """A PATH of this host's tools but no python: a host where QERL is a venv's qerl, or runs in a container."""
    b = tmp_path / "host-bin"
    b.mkdir()
    for d in ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            if not name.startswith("python") and not (b / name).exists():
                (b / name).symlink_to(os.path.join(d, name))
    return str(b)


@pytest.mark.parametrize("python", ["beside", "PYTHON", "none"])
def test_the_recipes_helpers_run_on_the_python_qerl_runs(tmp_path, python):
    # SHUFFLE=auto read a begun run dir's rollouts with `python3` alone: on a host without one (QERL a venv's qerl) it
    # exited 2, and the resume shortcut fell back to step 0 without a word (a review, session 59). Now the python beside
    # an absolute QERL, or PYTHON; without any, a message naming PYTHON, and a note where steps are gone through again.
    import shlex

    venv = tmp_path / "venv"
    venv.mkdir()
    log = tmp_path / "qerl.log"
    qerl = _recorder(venv, "qerl", f'printf "%q " "$@" >> {log}; echo >> {log}\n')
    env = {**os.environ, "PATH": _host_without_python(tmp_path), "QERL": str(qerl)}
    if python == "beside":
        (venv / "python3").symlink_to(sys.executable)
    elif python == "PYTHON":
        env["PYTHON"] = sys.executable
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=4\nEVAL_DATASET=\n")
    run = tmp_path / "run"
    _finished_steps(run, 3)
    _rollout_made(run / "step-000000" / "shards", False)  # begun in file order, before the knob
    cmd = ["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if python == "none":
        assert r.returncode == 2 and not log.exists(), r.stderr
        assert r.stderr.startswith(f"error: SHUFFLE=auto: reading how {run}'s rollouts were made takes a Python 3 on this "
                                   "host, and none was found (looked for python3 "), r.stderr
        assert r.stderr.endswith("): set PYTHON=/path/to/python3, or SHUFFLE=1 or 0\n"), r.stderr
        r = subprocess.run(cmd, env={**env, "SHUFFLE": "0"}, capture_output=True, text=True)
        assert r.returncode == 0 and "note: no Python 3 found on this host (looked for " in r.stderr, r.stderr
        assert "every step is gone through from step 0; set PYTHON=/path/to/python3 to skip them" in r.stderr
        first = "step-000000/shards"
    else:
        assert r.returncode == 0 and "made in file order (no --shuffle), so this run keeps" in r.stderr, r.stderr
        assert "no Python 3" not in r.stderr
        first = "step-000002/shards"  # the resume point, read by resume_point.py
    rollouts = [shlex.split(x) for x in log.read_text().splitlines() if x.startswith("rollout ")]
    assert rollouts[0][rollouts[0].index("--out") + 1] == f"{run}/{first}" and not any("--shuffle" in a for a in rollouts)
    # QERL="python -m qerl_cli": its python
    (venv / "python3.11").symlink_to(sys.executable)
    r = subprocess.run(["bash", "-c", f'source {RECIPES / "lib.sh"}; QERL="{venv}/python3.11 -m qerl_cli"; '
                        'qerl_find_python; echo "$QERL_PYTHON"'], env={**env, "PYTHON": ""}, capture_output=True,
                       text=True)
    assert r.stdout == f"{venv}/python3.11\n", r.stderr



# The helpers the recipes run on the host: a python3 there may be 3.6 (RHEL 8's and CentOS 7's).
HOST_HELPERS = ("resume_point.py", "rollout_shuffle.py")


def _python36():
    """A Python 3.6 on this machine (PATH, or pyenv's; not its shim, which may run none), or None."""
    for c in [shutil.which("python3.6"), *sorted(Path.home().glob(".pyenv/versions/3.6*/bin/python3.6"))]:
        r = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True) if c else None
        if r is not None and r.stdout == "(3, 6)\n":
            return str(c)
    return None


@pytest.mark.parametrize("helper", HOST_HELPERS)
def test_the_recipes_host_helpers_evaluate_nothing_python_3_6_lacks(helper):
    # `from __future__ import annotations` is a SyntaxError before 3.7, and an unquoted `dict | None` a TypeError before
    # 3.10: a host python3 of 3.6 failed both helpers (a review, session 59). Checked here on any Python.
    import ast

    tree = ast.parse((RECIPES / helper).read_text(), feature_version=(3, 6))
    futures = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "__future__"
               for a in n.names]
    assert futures == [], futures
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes = [a.annotation for a in n.args.args + n.args.kwonlyargs] + [n.returns]
            for a in notes:  # a bare name (str, Path) is evaluated alike on 3.6; anything else quoted
                assert a is None or isinstance(a, ast.Name) or (isinstance(a, ast.Constant) and isinstance(a.value, str)), \
                    f"{helper}:{n.lineno}: {ast.unparse(a)}"


def test_the_recipes_helpers_run_on_a_host_python3_of_3_6(tmp_path):
    # RHEL 8's and CentOS 7's python3 is 3.6, found first on PATH: SHUFFLE=auto exited 2 on a begun run dir ("future
    # feature annotations is not defined"), and SHUFFLE=0's resume went through every step from step 0 unsaid, though
    # QERL's venv held a newer Python (a review, session 59).
    import shlex

    py36 = _python36()
    if py36 is None:
        pytest.skip("no Python 3.6 here (python3.6 on PATH, or pyenv's)")
    venv = tmp_path / "venv"
    venv.mkdir()
    log = tmp_path / "qerl.log"
    qerl = _recorder(venv, "qerl", f'printf "%q " "$@" >> {log}; echo >> {log}\n')
    (venv / "python3").symlink_to(sys.executable)
    host = _host_without_python(tmp_path)
    Path(host, "python3").symlink_to(py36)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PATH": host, "QERL": str(qerl)}
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=4\nEVAL_DATASET=\n")
    run = tmp_path / "run"
    _finished_steps(run, 3)
    _rollout_made(run / "step-000000" / "shards", False)  # begun in file order, before the knob
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "made in file order (no --shuffle), so this run keeps" in r.stderr, r.stderr
    rollouts = [shlex.split(x) for x in log.read_text().splitlines() if x.startswith("rollout ")]
    assert rollouts[0][rollouts[0].index("--out") + 1] == f"{run}/step-000002/shards"  # resume_point.py's
    # rollout_shuffle.py's other answer, its disagreeing rollouts (exit 3)
    _rollout_made(run / "step-000000" / "shards-0", True)
    r = subprocess.run([py36, str(RECIPES / "rollout_shuffle.py"), str(run), "4"], capture_output=True, text=True)
    assert r.returncode == 3 and "its rollouts disagree on --shuffle: shards without it, shards-0 with it" in r.stderr, \
        r.stderr

# ---- a live single-node Slurm (Debian's slurm-wlm + munge), started by the test ----------
def _slurm_binaries():
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "squeue", "munged", "munge"))


@pytest.fixture
def live_slurm(tmp_path):
    if not _slurm_binaries():
        pytest.skip("slurm-wlm/munge not installed (.ci/run installs them where apt-get works)")
    import socket
    import time

    host = socket.gethostname().split(".")[0]
    d = tmp_path / "slurm"
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=qerltest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/d.log
NodeName={host} CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        subprocess.run(["bash", "-c", "mkdir -p /run/munge; test -f /etc/munge/munge.key || mungekey -c; "
                        "chown -R munge:munge /run/munge /etc/munge 2>/dev/null; runuser -u munge -- munged || munged --force"],
                       capture_output=True)
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            pytest.skip("munged could not be started here")
    subprocess.run(["slurmctld", "-c", "-i"], env=env, check=True)
    subprocess.run(["slurmd"], env=env, check=True)
    try:
        for _ in range(50):
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if "idle" in out:
                break
            time.sleep(0.2)
        else:
            pytest.skip(f"slurm node never became idle: {out!r}")
        yield env
    finally:
        for pid in ("slurmd.pid", "slurmctld.pid"):
            f = d / pid
            if f.exists():
                subprocess.run(["kill", f.read_text().strip()], capture_output=True)


def test_live_slurm_runs_the_chain_in_dependency_order(tmp_path, live_slurm):
    import time

    log = tmp_path / "qerl.log"
    # Each fake stage records itself and sleeps a little, so a missing dependency shows as disorder.
    qerl = _recorder(tmp_path, "qerl", f'sleep 0.3; echo "$1 $SLURM_ARRAY_TASK_ID" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\nROLLOUT_SHARDS=2\n")
    env = {**live_slurm, "QERL": str(qerl), "GPU_GRES": ""}
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "run")],
                   env=env, check=True, capture_output=True, cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline:
        if not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
            break
        time.sleep(0.5)
    lines = log.read_text().split("\n")[:-1] if log.exists() else []
    stages = [line.split(" ")[0] for line in lines]
    # The base policy's eval runs beside the chain: after quantize, before the final job (merge).
    base_eval = stages.index("eval") if "eval" in stages else -1
    assert 0 < base_eval < stages.index("merge"), lines
    del stages[base_eval], lines[base_eval]
    assert stages == ["quantize", "rollout", "rollout", "train-step", "rollout", "rollout", "train-step", "merge", "eval",
                      "eval"], lines  # merged, --compare
    assert sorted(line.split(" ")[1] for line in lines[1:3]) == ["0", "1"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_force_redoes_only_the_stages_that_refuse(tmp_path):
    # FORCE=1 once put --force on every stage: changing MERGE_DTYPE redid quantize and the whole loop.
    # A stand-in qerl refuses merge (exit 4, as for changed inputs) unless forced; everything else is done.
    log = tmp_path / "qerl.log"
    body = (f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
            'if [ "$1" = merge ] && [[ " $* " != *" --force "* ]]; then echo "error: exists" >&2; exit 4; fi\n')
    qerl = _recorder(tmp_path, "qerl", body)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\n")
    env = {**os.environ, "QERL": str(qerl)}
    run = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 4  # without FORCE the refusal stops the loop
    # and names the variable that redoes it: the stage's own "pass --force" is no flag of grpo.sh (a review, session 57)
    assert run.stderr.endswith("error: exists\nnote: qerl merge refused (exit 4): FORCE=1 reruns this script redoing each "
                               "stage that refuses; a changed STEPS cannot extend a run (start a new RUN_DIR)\n"), run.stderr
    log.write_text("")
    err = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env={**env, "FORCE": "1"},
                         check=True, capture_output=True, text=True).stderr
    assert "error: exists\nFORCE=1: qerl merge refused above (exit 4" in err  # the error shown is being handled
    calls = [x.strip() for x in log.read_text().splitlines()]
    assert calls == ["quantize", "eval", "rollout", "train-step", "rollout", "train-step", "merge", "merge forced",
                     "eval", "eval"], calls  # the config's EVAL_DATASET: base, final, --compare


# What a stand-in qerl records of its failure where the script asks (QERL_ERROR_FILE: qerl_cli.cli.record_error, whose
# format test_a_stages_recorded_failure_is_what_the_recipes_read holds): `record CODE KIND MESSAGE`
RECORD = 'record() { [ -z "${QERL_ERROR_FILE:-}" ] || echo "$*" >> "$QERL_ERROR_FILE"; }\n'
# qerl eval's refusal to resume an eval stopped on another GPU model (eval_devices.check_made_on_this_gpu), as a
# stand-in qerl gives it: exit 4 unless --force
GPU_REFUSAL = (RECORD + 'if [ "$1" = eval ] && [[ " $* " != *" --force "* ]] && [[ " $* " != *" --compare "* ]]; then\n'
               '  echo "error: .e.partial-x holds this eval stopped on \'H100\', another GPU model than this \'A100\'" >&2\n'
               '  record 4 OtherGpuModelError .e.partial-x holds this eval stopped on ...\n'
               '  exit 4\nfi\n')
# and an eval's refusal of an output made from other inputs: no GPU model's note (it followed every eval's exit 4)
INPUTS_REFUSAL = GPU_REFUSAL.replace("OtherGpuModelError", "OutputExistsError").replace(
    ".e.partial-x holds this eval stopped on \'H100\', another GPU model than this \'A100\'",
    "e holds an eval output made from different inputs or arguments (max_new_tokens: 2048 -> 1024)")
# and to score again a finished eval another GPU model generated, where some problems must be generated anew (evaluate.py)
GPU_RESCORE_REFUSAL = GPU_REFUSAL.replace(".e.partial-x holds this eval stopped on \'H100\', another GPU model than this "
                                          "\'A100\'", "e was generated on \'H100\': scoring it again, some of its "
                                          "problems must be generated again (...), which this \'A100\' would do with other numerics")
# What grpo.sh and a Slurm job say after an eval's refusal: it said "an eval stopped on ...", wrong for a rescoring
GPU_NOTE = ("note: an eval begun on another GPU model, stopped there or to be scored again with problems generated anew (the "
            "line above says which), goes on only on a GPU of that model{}; FORCE=1 generates it all afresh here\n")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("refusal", [GPU_REFUSAL, GPU_RESCORE_REFUSAL], ids=["stopped", "rescored"])
def test_grpo_sh_says_an_evals_gpu_model_refusal_for_what_it_is(tmp_path, refusal):
    # The stage's exit 4 was announced as "made from other inputs" whatever refused, and an eval stopped on another GPU
    # model (its kept problems, which FORCE=1 throws away) was told only of FORCE=1 and a changed STEPS
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n' + refusal)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\n")
    env = {**os.environ, "QERL": str(qerl)}
    run = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 4
    assert run.stderr.endswith("(start a new RUN_DIR)\n" + GPU_NOTE.format("")), run.stderr
    err = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env={**env, "FORCE": "1"},
                         check=True, capture_output=True, text=True).stderr
    assert "FORCE=1: qerl eval refused above (exit 4); redoing it with --force" in err
    assert "made from other inputs" not in err


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("force", ["0", "1"])
def test_a_slurm_eval_job_requeued_onto_another_gpu_model_says_how_to_go_on(tmp_path, force):
    # A requeued eval job landing on a node of another GPU model is refused (exit 4): the job said nothing of FORCE=1
    # (the stage's hint says "pass --force", which a job takes only from submit.env) nor of a constraint, and with
    # FORCE=1 called the refusal "made from other inputs"
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n' + GPU_REFUSAL)
    cfg, run = _submit_7b_chain(tmp_path, FORCE=force)
    env = {k: v for k, v in os.environ.items() if k != "FORCE"} | {"QERL": str(qerl)}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "eval", str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    if force == "1":
        assert r.returncode == 0 and "FORCE=1: the stage refused above (exit 4); redoing it with --force" in r.stderr
        assert "made from other inputs" not in r.stderr
        return
    assert r.returncode == 4
    assert r.stderr.endswith(f"note: the stage refused (exit 4): FORCE=1 in {run}/submit.env (or a chain resubmitted "
                             "with FORCE=1) redoes it with --force\n"
                             + GPU_NOTE.format(" (a Slurm constraint: EXTRA_SBATCH_ARGS=--constraint=...)")), r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", ["grpo.sh", "stage.sbatch"])
def test_an_evals_refusal_of_other_inputs_gets_no_gpu_model_note(tmp_path, script):
    # Any exit 4 of an eval was followed by the note on an eval begun on another GPU model ("goes on only on a GPU of
    # that model"), an eval made from other inputs too (a review, session 59): now only the refusal the stage records
    # as that (OtherGpuModelError, QERL_ERROR_FILE) gets it
    qerl = _recorder(tmp_path, "qerl", INPUTS_REFUSAL)
    if script == "grpo.sh":
        cfg, run = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\n"), tmp_path / "run"
        cmd = ["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)]
    else:
        cfg, run = _submit_7b_chain(tmp_path)
        cmd = ["bash", str(RECIPES / "slurm" / "stage.sbatch"), "eval", str(cfg), str(run), "1"]
    r = subprocess.run(cmd, env={**os.environ, "QERL": str(qerl)}, capture_output=True, text=True)
    assert r.returncode == 4 and "made from different inputs" in r.stderr, r.stderr
    assert "redoes it with --force" in r.stderr or "FORCE=1 reruns this script" in r.stderr, r.stderr
    assert "another GPU model" not in r.stderr.split("made from different inputs")[1], r.stderr
    assert not list(run.glob(".qerl-error.*"))  # the record, read, is gone


def test_a_stages_recorded_failure_is_what_the_recipes_read(tmp_path, monkeypatch):
    # The recipes choose their notes from the line a failing stage appends to QERL_ERROR_FILE (qerl_cli.cli.record_error):
    # the real line, read by lib.sh's qerl_failed_with, for each kind they tell apart
    from qerl_cli.cli import record_error
    from qerl_cli.errors import OtherGpuModelError, OutputBusyError, OutputExistsError

    f = tmp_path / "rec"
    monkeypatch.setenv("QERL_ERROR_FILE", str(f))
    want = {"gpu": "4 OtherGpuModelError", "inputs": "4 OutputExistsError", "busy": "8 OutputBusyError"}
    for kind, e in (("gpu", OtherGpuModelError("e holds this eval stopped on 'H100',\nanother", hint="rerun")),
                    ("inputs", OutputExistsError("e holds an eval output made from different inputs")),
                    ("busy", OutputBusyError("e was written by another run"))):
        f.write_text("")
        record_error(e)
        assert f.read_text().count("\n") == 1  # one line, whatever the message holds
        checks = " ".join(f"$(qerl_failed_with {w} && echo 1 || echo 0)" for w in want.values())
        r = subprocess.run(["bash", "-c", f'source {RECIPES / "lib.sh"}; QERL_FAILED=$(< "$1"); echo {checks}; '
                            'echo "$(qerl_failed_with 4 && echo 1 || echo 0) $(qerl_failed_with 8 && echo 1 || echo 0)"',
                            "x", str(f)], capture_output=True, text=True, check=True)
        assert r.stdout.split("\n")[0] == " ".join("1" if k == kind else "0" for k in want), (kind, r.stdout)
        assert r.stdout.split("\n")[1] == ("0 1" if kind == "busy" else "1 0"), (kind, r.stdout)


@pytest.mark.parametrize("force", ["0", "1"])
@pytest.mark.parametrize("recorded", ["", "record 2 BadInputError --shards x: no shard files\n"], ids=["crash", "bad-input"])
def test_a_torchrun_jobs_other_failure_is_not_taken_for_a_refusal(tmp_path, force, recorded):
    # torchrun exits 1 whatever its ranks' codes: a failure of a multi-GPU train job on a step whose adapter was finished
    # before it was taken for the refusal (a review, session 59): redone with --force under FORCE=1, and otherwise told
    # "the stage refused it ... FORCE=1 redoes it". Now only the exit 4 its ranks record is the refusal.
    log = tmp_path / "qerl.log"
    body = (RECORD + f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
            + recorded.replace("record", 'echo "error: no shard files" >&2; record') + "exit 1\n")
    qerl = _recorder(tmp_path, "qerl", body)
    _recorder(tmp_path, "torchrun", f'shift 4; "{qerl}" "$@" || exit 1\n')
    cfg, run = _submit_7b_chain(tmp_path, FORCE=force, TRAIN_GPUS="2")
    (run / "step-000001" / "adapter").mkdir(parents=True)
    (run / "step-000001" / "adapter" / "manifest.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "FORCE"} | {"QERL": str(qerl)}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    calls = [x.strip() for x in log.read_text().splitlines()]
    assert r.returncode == 1 and calls == ["train-step"], r.stderr
    assert "the stage refused (" not in r.stderr and "--force" not in r.stderr, r.stderr
    # a crash records nothing, as a refusal through a wrapper that passes no environment on: said so, not redone
    assert ("no rank recorded why" in r.stderr) == (recorded == ""), r.stderr


@pytest.mark.parametrize("force", ["0", "1"])
def test_a_torchrun_jobs_refusal_through_a_wrapper_without_the_environment_is_said(tmp_path, force):
    # A launcher that passes no environment on drops QERL_ERROR_FILE: a refused multi-GPU train job then failed without
    # a word, where before the record it was told of FORCE=1 (and redone under it, as any failure was; a review, session
    # 59). Now said, naming the record it lacks; still not redone. (A QERL wrapper gets the file named inside it since
    # session 60, test_a_torchrun_jobs_refusal_crosses_a_wrapper_that_clears_the_environment: here a TORCHRUN one.)
    log = tmp_path / "qerl.log"
    body = (RECORD + f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
            'if [[ " $* " != *" --force "* ]]; then echo "error: exists" >&2; record 4 OutputExistsError exists; exit 4; fi\n')
    qerl = _recorder(tmp_path, "qerl", body)
    torchrun = _recorder(tmp_path, "torchrun", f'shift 4; "{qerl}" "$@" || exit 1\n')
    cfg, run = _submit_7b_chain(tmp_path, FORCE=force, TRAIN_GPUS="2")
    (run / "step-000001" / "adapter").mkdir(parents=True)
    (run / "step-000001" / "adapter" / "manifest.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "FORCE"} | {"QERL": str(qerl),
                                                                   "TORCHRUN": f"env -u QERL_ERROR_FILE {torchrun}"}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1 and log.read_text().split() == ["train-step"], r.stderr
    assert (f"note: torchrun failed (exit 1) on {run}/step-000001/adapter, finished before this job, and no rank "
            "recorded why: where a rank's exitcode above is 4, the stage refused it, and QERL_ERROR_FILE did not reach "
            "the stage") in r.stderr, r.stderr
    # a job the ranks record for, on a step not finished before: no such note
    (run / "step-000001" / "adapter" / "manifest.json").unlink()
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"],
                       env=env | {"TORCHRUN": str(torchrun)}, capture_output=True, text=True)
    assert "no rank recorded why" not in r.stderr and ("redoing it with --force" in r.stderr) == (force == "1"), r.stderr


@pytest.mark.parametrize("stale", ["python2", "not-there"])
def test_a_python_that_is_not_python_3_is_named_once_and_passed_over(tmp_path, stale):
    # PYTHON is other tools' variable too (node-gyp's, a Makefile's PYTHON=python2): a PYTHON that was no Python 3
    # stopped the recipes' search, and the script said "no Python 3 found on this host (PYTHON=...)" with python3 on
    # PATH: SHUFFLE=auto in a begun run dir exited 2, and the resume went through every step (session 59's list).
    # Now one note names it and the next candidate runs the helpers; without any, the error names it beside them.
    import shlex

    host = Path(_host_without_python(tmp_path))
    (host / "setpriv").unlink(missing_ok=True)  # the death signal's prctl looks for a Python too: one note still
    (host / "python3").symlink_to(sys.executable)
    bad = str(_recorder(tmp_path, "python2", 'echo "Python 2.7.18" >&2; exit 1\n')) if stale == "python2" else "/no/python3"
    qerl, log = _argv_recorder(tmp_path)
    env = {**os.environ, "PATH": str(host), "QERL": str(qerl), "PYTHON": bad}
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=4\nEVAL_DATASET=\nBASE_FORMAT=bf16\n")
    run = tmp_path / "run"
    _finished_steps(run, 3)
    _rollout_made(run / "step-000000" / "shards", False)  # begun in file order, before the knob
    note = f"note: PYTHON={bad} is not a Python 3 (3.6 or later) that runs here: the recipes' helpers look for another\n"
    for shuffle in ("auto", "0"):  # SHUFFLE=0: the resume point is the first to look
        log.unlink(missing_ok=True)
        r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env | {"SHUFFLE": shuffle},
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr.count(note) == 1 and "no Python 3" not in r.stderr, r.stderr
        rollouts = [shlex.split(x) for x in log.read_text().splitlines() if x.startswith("rollout ")]
        assert rollouts[0][rollouts[0].index("--out") + 1] == f"{run}/step-000002/shards"  # resume_point.py's
    (host / "python3").unlink()
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count(note) == 1, r.stderr
    assert f"none was found (looked for PYTHON={bad} (not Python 3.6+) and python3 " in r.stderr, r.stderr


# Host python3s the helpers cannot run on, as stand-ins over this Python: one built without libffi (no ctypes: pyenv's
# on a host without libffi-devel), and a 3.5 (SLES 12's 3.4, Ubuntu 16.04's 3.5), to which every f-string (the death
# signal's prctl program, resume_point.py, rollout_shuffle.py) is a SyntaxError.
UNFIT_PYTHONS = {
    "no-ctypes": 'for a; do case $a in *"import ctypes"*) echo "ModuleNotFoundError: No module named \'_ctypes\'" >&2; '
                 'exit 1 ;; esac; done\nexec {python} "$@"\n',
    "3.5": 'code="" prev=""; for a; do [ "$prev" = -c ] && code=$a; prev=$a; done\n'
           'case $code in "" | *\'f"\'*) echo "SyntaxError: invalid syntax" >&2; exit 1 ;; esac\n'
           'exec {python} -c \'import sys; sys.version_info = (3, 5, 10, "final", 0); exec(sys.argv[1])\' "$code"\n',
}


@pytest.mark.parametrize("python", sorted(UNFIT_PYTHONS))
def test_a_host_python_the_helpers_cannot_run_on_starts_the_stages_all_the_same(tmp_path, python):
    # Without setpriv (RHEL 8's util-linux), the death signal is set by the host Python's prctl: a python3 without ctypes
    # or older than 3.6 was taken for it, and every stage failed to start (exit 1, "No module named '_ctypes'" or a
    # SyntaxError; review s60r08). Now such a Python is passed over: the stages run, without the kernel's SIGTERM.
    host = Path(_host_without_python(tmp_path))
    (host / "setpriv").unlink(missing_ok=True)
    _recorder(host, "python3", UNFIT_PYTHONS[python].format(python=sys.executable))
    qerl, log = _argv_recorder(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\nEVAL_DATASET=\nBASE_FORMAT=bf16\n")
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], capture_output=True,
                       text=True, env={**os.environ, "PATH": str(host), "QERL": str(qerl), "PYTHON": ""})
    assert r.returncode == 0, r.stderr
    assert [x.split()[0] for x in log.read_text().splitlines()] == ["rollout", "train-step", "merge"]


def _clearing_wrapper(tmp_path) -> Path:
    """A stand-in for `apptainer exec --cleanenv IMAGE CMD...` (docker run without -e, srun --export=NONE): CMD runs
    with an environment of its own, PATH alone."""
    return _recorder(tmp_path, "wrap", 'shift 2; exec env -i PATH="$PATH" "$@"\n')


@pytest.mark.parametrize("script", ["grpo.sh", "stage.sbatch"])
def test_a_stages_record_crosses_a_wrapper_that_clears_the_environment(tmp_path, script):
    # QERL="apptainer exec --cleanenv img.sif qerl" dropped QERL_ERROR_FILE: the eval's refusal on another GPU model
    # lost its note (and a torchrun job its refusal, below; session 59's list). The file is named inside the wrapper.
    log = tmp_path / "qerl.log"
    (tmp_path / "bin").mkdir()
    qerl = _recorder(tmp_path / "bin", "qerl", f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
                     + GPU_REFUSAL)
    if script == "grpo.sh":
        cfg, run = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\n"), tmp_path / "run"
        cmd, note = ["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], GPU_NOTE.format("")
    else:
        cfg, run = _submit_7b_chain(tmp_path)
        cmd = ["bash", str(RECIPES / "slurm" / "stage.sbatch"), "eval", str(cfg), str(run), "1"]
        note = GPU_NOTE.format(" (a Slurm constraint: EXTRA_SBATCH_ARGS=--constraint=...)")
    env = {**os.environ, "QERL": f"{_clearing_wrapper(tmp_path)} exec img.sif {qerl}"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 4 and r.stderr.endswith(note), r.stderr
    assert not list(run.glob(".qerl-error.*"))  # the record, read, is gone


@pytest.mark.parametrize("script, triton", [("grpo.sh", None), ("stage.sbatch", None), ("stage.sbatch", "/mine")])
def test_the_stop_with_parent_flag_and_the_kernel_cache_cross_a_wrapper_that_clears_the_environment(tmp_path, script,
                                                                                                     triton):
    # Dropped as QERL_ERROR_FILE was (session 60's list): grpo.sh's QERL_STOP_WITH_PARENT=1, so a stage under a wrapper
    # that forks it ran on, orphaned, once grpo.sh was killed and the wrapper died of the TERM passed on
    # (test_a_stage_in_its_own_group_stops_when_grpo_sh_dies: what the variable does); and stage.sbatch's
    # TRITON_CACHE_DIR in the run dir, so each job compiled its kernels anew or kept them in $HOME. Both are named inside
    # the wrapper, a FORCE=1 job's rerun with --force included; a TRITON_CACHE_DIR of one's own is left to the
    # environment (its path may not be there inside a container)
    log = tmp_path / "qerl.log"
    (tmp_path / "bin").mkdir()
    qerl = _recorder(tmp_path / "bin", "qerl", f'echo "$1 ${{QERL_STOP_WITH_PARENT:-unset}} ${{TRITON_CACHE_DIR:-unset}}" '
                     f'>> {log}\n[[ " $* " == *" --force "* ]] || [ "$1" != rollout ] || [ "{script}" = grpo.sh ] || exit 4\n')
    env = {k: v for k, v in os.environ.items() if k not in ("QERL_STOP_WITH_PARENT", "TRITON_CACHE_DIR", "FORCE")}
    env["QERL"] = f"{_clearing_wrapper(tmp_path)} exec img.sif {qerl}"
    if script == "grpo.sh":
        cfg, run = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\n"), tmp_path / "run"
        subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(run)], env=env, check=True, capture_output=True)
        lines = log.read_text().splitlines()
        assert len(lines) == 7 and all(x.split()[1:] == ["1", "unset"] for x in lines), lines  # 3 evals, --compare
        return
    if triton:
        env["TRITON_CACHE_DIR"] = triton
    cfg, run = _submit_7b_chain(tmp_path, FORCE="1")
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(run), "1"], env=env,
                   check=True, capture_output=True)
    want = "unset" if triton else f"{run}/.triton-cache"
    assert log.read_text().splitlines() == [f"rollout unset {want}"] * 2  # refused, then redone with --force


@pytest.mark.parametrize("force", ["0", "1"])
def test_a_torchrun_jobs_refusal_crosses_a_wrapper_that_clears_the_environment(tmp_path, force):
    # torchrun runs inside QERL's wrapper, where the ranks' record of an exit 4 (torchrun's exit 1) was lost with the
    # environment: the refusal was not redone under FORCE=1, nor told of FORCE=1 without it
    log = tmp_path / "qerl.log"
    (tmp_path / "bin").mkdir()
    qerl = _recorder(tmp_path / "bin", "qerl", RECORD + f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
                     'if [[ " $* " != *" --force "* ]]; then echo "error: exists" >&2; record 4 OutputExistsError exists; exit 4; fi\n')
    _recorder(tmp_path / "bin", "torchrun", f'shift 4; "{qerl}" "$@" || exit 1\n')  # beside an absolute QERL: its own
    cfg, run = _submit_7b_chain(tmp_path, FORCE=force, TRAIN_GPUS="2")
    (run / "step-000001" / "adapter").mkdir(parents=True)
    (run / "step-000001" / "adapter" / "manifest.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE", "TORCHRUN")}
    env["QERL"] = f"{_clearing_wrapper(tmp_path)} exec img.sif {qerl}"
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    assert "no rank recorded why" not in r.stderr, r.stderr
    if force == "1":
        assert r.returncode == 0 and log.read_text().split("\n")[:2] == ["train-step ", "train-step forced"], r.stderr
    else:
        assert r.returncode == 1 and "note: the stage refused (a rank's exit 4, torchrun's 1): FORCE=1" in r.stderr


def _submit_7b_chain(tmp_path, **env):
    """submit.sh on the 7B config (3 steps) through a fake sbatch, with ``env`` in its environment."""
    sbatch, _ = _fake_sbatch(tmp_path)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=3\n")
    run = tmp_path / "run"
    subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(run)], check=True, capture_output=True,
                   env={**os.environ, "SBATCH": str(sbatch), **env})
    return cfg, run


def _force_chain_job(tmp_path, force, stage, **chain_env):
    """A job of a chain submitted with FORCE=``force``, whose stand-in qerl refuses (exit 4) unless --force:
    (the job's result, the qerl calls it made)."""
    log = tmp_path / "qerl.log"
    body = (RECORD + f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
            'if [[ " $* " != *" --force "* ]]; then echo "error: exists" >&2; record 4 OutputExistsError exists; exit 4; fi\n')
    qerl = _recorder(tmp_path, "qerl", body)
    # torchrun beside an absolute QERL is the one stage.sbatch runs; like the real one it exits 1 on a failed rank
    _recorder(tmp_path, "torchrun", f'shift 4; "{qerl}" "$@" || exit 1\n')
    cfg, run = _submit_7b_chain(tmp_path, FORCE=force, **chain_env)
    assert f"FORCE={force}" in (run / "submit.env").read_text()
    (run / "step-000001" / "adapter").mkdir(parents=True)
    (run / "step-000001" / "adapter" / "manifest.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "FORCE"} | {"QERL": str(qerl)}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    return r, [x.strip() for x in log.read_text().splitlines()]


@pytest.mark.parametrize("force", ["0", "1"])
@pytest.mark.parametrize("stage, gpus, qerl_stage, refused_rc", [
    ("rollout", "1", "rollout", 4),
    # torchrun exits 1 when a rank exits 4 (ChildFailedError), so the FORCE wrapper never saw the refusal of a
    # TRAIN_GPUS > 1 job: a changed LR failed the job and afterok cancelled the chain (a review)
    ("train", "2", "train-step", 1),
])
def test_a_slurm_job_of_a_force_chain_redoes_a_refusing_stage(tmp_path, force, stage, gpus, qerl_stage, refused_rc):
    # stage.sbatch had no FORCE: a FORCE=1 chain (submit.sh's comment promised a restart) failed its first
    # refusing job with exit 4 and afterok cancelled the rest. The chain's FORCE is in submit.env.
    r, calls = _force_chain_job(tmp_path, force, stage, TRAIN_GPUS=gpus)
    if force == "1":
        assert r.returncode == 0 and calls == [qerl_stage, f"{qerl_stage} forced"], r.stderr
        assert "redoing it with --force" in r.stderr
    else:
        assert r.returncode == refused_rc and calls == [qerl_stage], r.stderr
        # and says how to redo it: torchrun's exit 1 (not 4) left a refused multi-GPU train job without a word of FORCE
        assert f"FORCE=1 in {tmp_path}/run/submit.env (or a chain resubmitted with FORCE=1) redoes it" in r.stderr, r.stderr


def test_a_force_chains_torchrun_job_does_not_force_over_an_output_another_chain_wrote_meanwhile(tmp_path):
    # torchrun turns the stage's exit 8 (another run wrote --out while this one ran) into 1; stage.sbatch took any
    # failure with a manifest at --out for the exit-4 refusal and redid the step with --force over the other chain's
    log = tmp_path / "qerl.log"
    body = (RECORD + f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n'
            'out=$(for a in "$@"; do [ "${prev:-}" = --out ] && echo "$a"; prev=$a; done)\n'
            'mkdir -p "$out"; echo "{}" > "$out/manifest.json"\n'
            'echo "error: $out was written by another run while this one ran" >&2\n'
            'record 8 OutputBusyError "$out was written by another run while this one ran"; exit 8\n')
    qerl = _recorder(tmp_path, "qerl", body)
    _recorder(tmp_path, "torchrun", f'shift 4; "{qerl}" "$@" || exit 1\n')
    cfg, run = _submit_7b_chain(tmp_path, FORCE="1", TRAIN_GPUS="2")
    env = {k: v for k, v in os.environ.items() if k != "FORCE"} | {"QERL": str(qerl)}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    calls = [x.strip() for x in log.read_text().splitlines()]
    assert r.returncode == 1 and calls == ["train-step"] and "redoing it with --force" not in r.stderr, r.stderr


def test_a_slurm_job_rerun_alone_reads_every_shard_of_the_chain(tmp_path):
    # Submitted with ROLLOUT_SHARDS=2 in the environment, a train job resubmitted by hand without it
    # read shards-0 only (1/N of the step) and exit 0. submit.sh records the chain's shape.
    cfg, run = _submit_7b_chain(tmp_path, ROLLOUT_SHARDS="2")
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$*" >> {log}\n')
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_SHARDS"} | {"QERL": str(qerl)}
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"], env=env,
                   check=True)
    assert f"--shards {run}/step-000001/shards-0 --shards {run}/step-000001/shards-1 " in log.read_text()
    # and a train job that would read fewer shards than the step holds refuses
    (run / "submit.env").unlink()
    for i in range(2):
        (run / "step-000001" / f"shards-{i}").mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "1"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "ROLLOUT_SHARDS=1" in r.stderr


def test_a_slurm_rollout_rerun_alone_samples_with_the_chains_settings(tmp_path):
    # Submitted with PROMPTS_PER_STEP=4 in the environment, a rollout task rerun by hand without it
    # sampled the config's default prompt count into the same step, and train-step trained on the mix
    # (2026-11-26 audit). submit.env now keeps every value of the config as submitted.
    cfg, run = _submit_7b_chain(tmp_path, PROMPTS_PER_STEP="4", NUM_GENERATIONS="4", LR="5e-6", SEED="7")
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$*" >> {log}\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PROMPTS_PER_STEP", "NUM_GENERATIONS", "LR", "SEED")}
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(run), "1"],
                   env={**env, "QERL": str(qerl), "SLURM_ARRAY_TASK_ID": "0"}, check=True, capture_output=True)
    args = log.read_text().split()
    assert args[args.index("--prompts-per-step") + 1] == "4", args
    assert args[args.index("--num-generations") + 1] == "4", args  # every config key takes the environment's
    assert args[args.index("--seed") + 1] == "7", args


@pytest.mark.parametrize("stage, step", [
    ("train", "000002"),  # step-000002's name: bash read 000012 as octal 10, and wrote step-000010's adapter
    ("rollout", "000010"),  # octal 8: step-000008's shards, rolled out with qerl's --step 10 from adapter 7
    ("eval", "08"),  # no octal number: "invalid octal number", then step 0
    ("train", None), ("rollout", None), ("eval", None),  # step 0, not the step meant
    ("train", "3"), ("rollout", "-1"), ("eval", "-2"), ("train", "x"),  # past the run's 3 steps, not a step
])
def test_a_job_run_by_hand_takes_only_a_step_of_the_run(tmp_path, stage, step):
    cfg, run = _submit_7b_chain(tmp_path)
    qerl, log = _argv_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "SLURM_ARRAY_TASK_ID": "0"}
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run),
                        *([step] if step else [])], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and not log.exists(), (r.stderr, log.exists() and log.read_text())
    assert f"error: STEP={step or '(none)'}: {stage} takes a step of the run, {-1 if stage == 'eval' else 0} to 2 " \
           "(STEPS=3), without leading zeros (step-000012 is 12)" in r.stderr, r.stderr
    # and the step, as a number, runs that step (eval: -1 too)
    for ok in ["2", "0"] + (["-1"] if stage == "eval" else []):
        subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), ok], env=env,
                       check=True, capture_output=True)
    outs = [line.split("--out ", 1)[1].split(" ", 1)[0] for line in log.read_text().splitlines()]
    want = {"rollout": "shards-0", "train": "adapter", "eval": "eval"}[stage]
    assert outs[:2] == [f"{run}/step-000002/{want}", f"{run}/step-000000/{want}"], outs


def test_a_rollout_job_of_several_tasks_outside_an_array_is_refused(tmp_path):
    # sbatch stage.sbatch rollout ... without --array rolled out task 0 of the chain's 2 alone, said "already done" and
    # exited 0: the task meant (a failed one) stayed missing, and the train job then failed on it
    cfg, run = _submit_7b_chain(tmp_path, ROLLOUT_SHARDS="2")
    qerl, log = _argv_recorder(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "SLURM_ARRAY_TASK_ID"} | {"QERL": str(qerl)}
    cmd = ["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(run), "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and not log.exists(), r.stderr
    assert "error: ROLLOUT_SHARDS=2: a rollout job is a task of an array: sbatch --array=0-1 (or --array=i" in r.stderr
    subprocess.run(cmd, env={**env, "SLURM_ARRAY_TASK_ID": "1"}, check=True, capture_output=True)
    assert f"--out {run}/step-000001/shards-1 --shard-index 1 --num-shards 2 " in log.read_text()


def test_submit_env_keeps_what_only_the_environment_set(tmp_path):
    # submit.env kept only what CONFIG assigns: submitted with RUN_SEED=5, a rollout task rerun alone
    # sampled with --run-seed 0 (and lost DTYPE, the chat template, ...). It now records every value the
    # stages read, resolved at submission.
    cfg, run = _submit_7b_chain(tmp_path, RUN_SEED="5", DTYPE="bf16", CHAT_TEMPLATE_FILE="/t/chat.jinja",
                                EVAL_MAX_PROBLEMS="7", MERGE_DTYPE="nvfp4")
    qerl, log = _argv_recorder(tmp_path)
    gone = ("RUN_SEED", "DTYPE", "CHAT_TEMPLATE_FILE", "EVAL_MAX_PROBLEMS", "MERGE_DTYPE")
    env = {k: v for k, v in os.environ.items() if k not in gone} | {"QERL": str(qerl), "SLURM_ARRAY_TASK_ID": "0"}
    for stage, step in [("rollout", 1), ("eval", -1), ("final", 0)]:
        subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), str(step)],
                       env=env, check=True, capture_output=True)
    rollout, evaluation, merge = log.read_text().splitlines()[:3]
    assert "--run-seed 5 " in rollout and "--dtype bf16" in rollout and "--chat-template-file /t/chat.jinja" in rollout
    assert "--max-problems 7 " in evaluation and "--chat-template-file /t/chat.jinja" in evaluation
    assert "--dtype nvfp4 --requantize-from " in merge


def test_a_jobs_first_line_names_a_step_only_for_the_stages_that_take_one(tmp_path):
    # quantize and final take no STEP, and their logs began "stage.sbatch final (step 0): settings from ...", the final
    # job merging step STEPS-1's adapter (a review, session 57).
    cfg, run = _submit_7b_chain(tmp_path)
    qerl, _ = _argv_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl)}
    for stage, step, said in (("quantize", [], "quantize: "), ("final", [], "final: "), ("train", ["2"], "train (step 2): ")):
        err = subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), stage, str(cfg), str(run), *step], env=env,
                             check=True, capture_output=True, text=True).stderr
        assert err.startswith(f"stage.sbatch {said}settings from {run}/submit.env"), err


def test_a_rerun_takes_its_settings_from_submit_env_and_says_so(tmp_path):
    # A job rerun with MICRO_BATCH_TOKENS=4096 in the environment (to avoid an OOM) silently ran with the
    # chain's value. The chain's values still win (the chain stays consistent), but the job says where its
    # settings come from and which of the environment's it does not use; editing submit.env changes them.
    cfg, run = _submit_7b_chain(tmp_path)
    qerl, log = _argv_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "MICRO_BATCH_TOKENS": "4096"}
    cmd = ["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "0"]
    err = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stderr
    assert "--micro-batch-tokens 8192 " in log.read_text()  # the 7B config's
    assert f"settings from {run}/submit.env" in err and "MICRO_BATCH_TOKENS differ" in err, err
    env_file = run / "submit.env"
    env_file.write_text(env_file.read_text().replace("MICRO_BATCH_TOKENS=8192", "MICRO_BATCH_TOKENS=4096"))
    log.write_text("")
    err = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stderr
    assert "--micro-batch-tokens 4096 " in log.read_text() and "differ" not in err


@pytest.mark.parametrize("script", ["grpo.sh", "stage.sbatch", "submit.sh"])
def test_an_unknown_base_format_is_refused(tmp_path, script):
    # BASE_FORMAT=NVFP4 (anything but nvfp4) ran the 16-bit baseline without a word.
    qerl, log = _argv_recorder(tmp_path)
    sbatch, sbatch_log = _fake_sbatch(tmp_path)
    cfg = tmp_path / "c.env"
    cfg.write_text((RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text())
    argv = {"grpo.sh": [RECIPES / "grpo.sh", cfg, tmp_path / "run"],
            "stage.sbatch": [RECIPES / "slurm" / "stage.sbatch", "rollout", cfg, tmp_path / "run", 0],
            "submit.sh": [RECIPES / "slurm" / "submit.sh", cfg, tmp_path / "run"]}[script]
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch), "BASE_FORMAT": "NVFP4"}
    r = subprocess.run(["bash", *map(str, argv)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "error: BASE_FORMAT=NVFP4: use nvfp4 (QeRL) or bf16" in r.stderr, r.stderr
    assert not log.exists() and not sbatch_log.exists()


@pytest.mark.parametrize("script", ["grpo.sh", "submit.sh"])
@pytest.mark.parametrize("value", ["abc", "1.5", "00", "08", "010"])
def test_a_step_count_that_is_not_a_number_is_one_error_line(tmp_path, script, value):
    # (review) leading zeros: STEPS=00 ran no step and merged step--00001, 08 broke the config's arithmetic,
    # 010 ran 8 steps (octal) with --total-steps 010 (read as 10)
    # the configs compute WARMUP_STEPS from STEPS as they are sourced: STEPS=abc ended in bash's
    # "abc: unbound variable" (exit 1), STEPS=1.5 in a syntax error and "does not set WARMUP_STEPS" (docs audit)
    path = RECIPES / script if script == "grpo.sh" else RECIPES / "slurm" / script
    for cfg in CONFIGS:
        r = subprocess.run(["bash", str(path), str(cfg), str(tmp_path / "run")], capture_output=True, text=True,
                           env={**os.environ, "STEPS": value, "QERL": "false", "SBATCH": "false"})
        assert r.returncode == 2 and r.stderr == f"error: STEPS={value}: expected a whole number\n", (cfg.name, r.stderr)


@pytest.mark.parametrize("script", ["grpo.sh", "submit.sh"])
@pytest.mark.parametrize("setting, needle", [
    ("LR=abc", "LR=abc: expected a number >= 0"), ("TEMPERATURE=-1", "TEMPERATURE=-1: expected a number >= 0"),
    ("MICRO_BATCH_TOKENS=0", "MICRO_BATCH_TOKENS=0: expected at least 1"),
    ("NUM_GENERATIONS=1", "NUM_GENERATIONS=1: a group needs at least 2 completions"),
    ("LORA_RANK=1.5", "LORA_RANK=1.5: expected a whole number"),
    ("WARMUP_STEPS=5", "WARMUP_STEPS=5: must be below STEPS=3"),
    # zeros train-step or the first rollout refused only when it ran (a review, session 50)
    ("LORA_ALPHA=0", "LORA_ALPHA=0: expected a number > 0"), ("LORA_ALPHA=0.0e3", "LORA_ALPHA=0.0e3: expected a number > 0"),
    ("AQN_STAGES=0", "AQN_STAGES=0: AQN is on"), ("AQN_SIGMA_END=0", "AQN_SIGMA_END=0: must be > 0"),
])
def test_a_stage_value_that_cannot_run_stops_the_loop_before_any_stage(tmp_path, script, setting, needle):
    # Each was found by its stage only: LR=abc after quantize and a whole rollout, and on Slurm after the whole
    # chain was queued (a review, 2026-11-27).
    qerl, log = _argv_recorder(tmp_path)
    sbatch, sbatch_log = _fake_sbatch(tmp_path)
    path = RECIPES / script if script == "grpo.sh" else RECIPES / "slurm" / script
    key, value = setting.split("=")
    env = {**os.environ, "STEPS": "3", key: value, "QERL": str(qerl), "SBATCH": str(sbatch)}
    r = subprocess.run(["bash", str(path), str(RECIPES / "configs" / "qwen2.5-7b-instruct.env"), str(tmp_path / "run")],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {needle}") and r.stderr.count("\n") == 1, r.stderr
    assert not log.exists() and not sbatch_log.exists()


@pytest.mark.parametrize("settings", [
    {"AQN_SIGMA_START": "0", "AQN_SIGMA_END": "0", "AQN_STAGES": "0"},  # AQN off: no stage needed
    {"AQN_STAGES": "1", "AQN_SIGMA_END": "0"},  # one stage: sigma_start alone, no geometric end
    {"LORA_ALPHA": "0.5", "AQN_SIGMA_START": "0.0", "AQN_STAGES": "0"},
])
def test_zeros_a_stage_runs_with_pass_the_check(tmp_path, settings):
    env = {**os.environ, **settings}
    cfg = RECIPES / "configs" / "qwen2.5-7b-instruct.env"
    subprocess.run(["bash", "-c", f"set -euo pipefail; source {cfg}; source {RECIPES / 'lib.sh'}; qerl_load_config {cfg}"],
                   env=env, check=True)


def test_a_config_that_misses_keys_is_refused_naming_them(tmp_path):
    # grpo.sh checked 9 keys, then died with "SEED: unbound variable".
    qerl, log = _argv_recorder(tmp_path)
    cfg = tmp_path / "c.env"
    text = (RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text()
    cfg.write_text("\n".join(x for x in text.splitlines() if not x.startswith(("SEED=", "TOP_P="))))
    env = {k: v for k, v in os.environ.items() if k not in ("SEED", "TOP_P")} | {"QERL": str(qerl)}
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and f"error: {cfg} does not set TOP_P SEED " in r.stderr, r.stderr
    assert not log.exists()


def test_more_than_one_gpu_per_rollout_task_is_refused(tmp_path):
    # Nothing in qerl uses a second GPU in rollout (no tensor parallelism): ROLLOUT_GPUS=N left N-1 idle.
    sbatch, log = _fake_sbatch(tmp_path)
    cfg = tmp_path / "c.env"
    cfg.write_text((RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text())
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(cfg), str(tmp_path / "run")],
                       env={**os.environ, "SBATCH": str(sbatch), "ROLLOUT_GPUS": "4"}, capture_output=True, text=True)
    assert r.returncode == 2 and "raise ROLLOUT_SHARDS" in r.stderr and not log.exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_to_grpo_sh_reaches_the_running_stage(tmp_path, sig):
    # `kill <grpo.sh pid>` left the stage running, still writing: bash passes no signal to a foreground child.
    # A stand-in stage records the signal it gets and exits as qerl does (143 / 130); the script waits for
    # it, ends as killed by the signal (a shell's $?: 143 / 130, the stage's status) and starts no other stage.
    qerl, log = _signal_recorder(tmp_path, ' ${QERL_STOP_WITH_PARENT:-unset}')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\n")
    rc = _signal_once_started(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")],
                              {**os.environ, "QERL": str(qerl)}, log, sig)
    assert rc == -sig
    lines = log.read_text().splitlines()
    assert [x.split()[0] for x in lines] == ["quantize", "quantize"] and lines[1] == f"quantize got {sig.name[3:]}"
    with pytest.raises(ProcessLookupError):  # the stage is gone, not orphaned
        os.kill(int(lines[0].split()[1]), 0)
    assert lines[0].split()[2] == "1"  # and told to stop if the script dies (its own process group)


def _grpo_cfg(tmp_path):
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=2\n")
    return cfg


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
def test_ctrl_c_to_grpo_sh_stops_a_loop_around_it(tmp_path):
    # grpo.sh exited 130 after Ctrl-C, a normal exit: bash, which waits for a command to die of SIGINT before it
    # stops too, took the signal as handled, and a loop over seeds went on to the next whole run (a review).
    qerl, log = _signal_recorder(tmp_path)
    loop = tmp_path / "seeds.sh"
    loop.write_text(f'for s in 1 2; do bash {RECIPES / "grpo.sh"} {_grpo_cfg(tmp_path)} {tmp_path}/run$s; '
                    f'echo "loop: run $s exited $?" >> {log}; done\n')
    p = subprocess.Popen(["bash", str(loop)], env={**os.environ, "QERL": str(qerl)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True,  # a terminal's foreground job
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: _logged(log), "the first stage to log itself")
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground job's whole group
        assert p.wait(timeout=PATIENCE) == -signal.SIGINT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # a loop that went on
        _session_ends(p)
    assert [x.split()[0] for x in log.read_text().splitlines()] == ["quantize", "quantize"]  # no second run


_IGNORES_SIGINT = """import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as /usr/bin/time does while its command runs
sys.exit(subprocess.Popen(sys.argv[1:], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)).wait())
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
def test_ctrl_c_reaches_a_stage_whose_wrapper_ignores_it(tmp_path):
    # QERL="/usr/bin/time -v qerl": grpo.sh passed Ctrl-C to the wrapper alone, which ignores SIGINT, and the
    # stage ran to its end (a review). It goes to the stage's whole group now, as a terminal's Ctrl-C does.
    qerl, log = _signal_recorder(tmp_path)
    wrapper = tmp_path / "wrap.py"
    wrapper.write_text(_IGNORES_SIGINT)
    rc = _signal_once_started(["bash", str(RECIPES / "grpo.sh"), str(_grpo_cfg(tmp_path)), str(tmp_path / "run")],
                              {**os.environ, "QERL": f"{sys.executable} {wrapper} {qerl}"}, log, signal.SIGINT)
    assert log.read_text().splitlines()[1:] == ["quantize got INT"] and rc == -signal.SIGINT


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
def test_a_signal_as_the_command_starts_is_passed_on(tmp_path):
    # bash runs a trap as soon as it has forked a background command, before `$!` names it: a signal then found
    # no group to pass itself to, the script exited 143 and the command ran on, orphaned (1 in 14 under a stream
    # of signals; a review). Here the signal is sent by a DEBUG trap at the first command after the fork.
    # The command runs on only once the test lets it (a file, made after the script ended): a script that waited
    # for it never ends (where `took < 0.5` s and a `sleep 0.7` told it, and failed on a loaded machine).
    mark, go = tmp_path / "orphan", tmp_path / "go"
    script = (f'source {RECIPES / "lib.sh"}; set -T; before=${{!:-}}; sent=""\n'
              "trap 'if [ -z \"$sent\" ] && [ \"${!:-}\" != \"$before\" ]; then sent=1; kill -TERM $$; fi' DEBUG\n"
              f"qerl_run_forwarding sh -c 'until [ -e {go} ]; do sleep 0.05; done; echo ran on > {mark}'\n")
    p = subprocess.Popen(["bash", "-c", script], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rc = p.wait(timeout=PATIENCE)
        go.touch()
    finally:
        p.kill()
        _session_ends(p)  # the command, had it run on, has written the mark
    assert not mark.exists(), "the command ran on"
    assert rc == -signal.SIGTERM, p.stderr.read()


def test_config_knobs_set_in_the_environment_win(tmp_path):
    # compare_aqn.sh sets the variant through the environment; the Qwen configs assigned these outright,
    # so all three variants ran the same NVFP4 + AQN experiment.
    for cfg in CONFIGS:
        env = {**os.environ, "BASE_FORMAT": "bf16", "AQN_SIGMA_START": "0", "SEED": "7", "STEPS": "3", "LR": "5e-6"}
        out = subprocess.run(["bash", "-c", f'source "{cfg}" >/dev/null; echo "$BASE_FORMAT $AQN_SIGMA_START $SEED $STEPS $LR"'],
                             env=env, capture_output=True, text=True, check=True).stdout.split()
        assert out == ["bf16", "0", "7", "3", "5e-6"], (cfg.name, out)


def test_every_config_key_can_be_set_from_the_environment(tmp_path):
    # A trial's `REWARDS=... bash recipes/quickstart.sh` was ignored: tiny.env assigned REWARDS, LOSS,
    # TEMPERATURE, TOP_P outright. Every key a config assigns now takes the environment's value first.
    import re

    for cfg in CONFIGS:
        keys = sorted(set(re.findall(r"^(?:if \[ -z \"\$\{)?([A-Z][A-Z0-9_]*)[=+]", cfg.read_text(), re.M)) - {"ASSETS"})
        assert len(keys) >= 20, (cfg.name, keys)
        env = {**os.environ, **{k: f"env-{k}" for k in keys}}
        script = f'source "{cfg}" >/dev/null; ' + "; ".join(f'echo "${k}"' for k in keys)
        out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()
        assert out == [f"env-{k}" for k in keys], cfg.name
    # an empty TRAIN_EXTRA / PROMPT_TEMPLATE turns the config's extras off, an empty EVAL_DATASET the evals
    # (docs/recipes.md: "none: no eval"; `${EVAL_DATASET:-...}` had read empty as unset)
    for cfg in CONFIGS:
        env = {**os.environ, "TRAIN_EXTRA": "", "PROMPT_TEMPLATE": "", "EVAL_DATASET": ""}
        out = subprocess.run(["bash", "-c", f'source "{cfg}"; echo "[$TRAIN_EXTRA][$PROMPT_TEMPLATE][$EVAL_DATASET]"'],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert out == "[][][]", (cfg.name, out)


def test_a_short_run_of_a_config_spreads_its_aqn_stages_over_its_steps():
    # tiny.env's 4 stages (the Qwen configs' 10) over a quickstart of STEPS <= 4 made every rollout warn "--total-steps
    # 3 < --aqn-stages 4 + 1: the AQN schedule skips stages" (session 60's list): a shorter run takes one stage a step
    # after its noise-free first, and a run of the config's length or longer its stages as before
    import warnings

    from qerl_cli.rollout_checks import warn_of_skipped_aqn_stages

    for cfg in CONFIGS:
        script = (f'for s in $(seq 1 12); do (STEPS=$s; source "{cfg}" >/dev/null; source "{RECIPES / "lib.sh"}"; '
                  f'qerl_load_config "{cfg}"; echo "$STEPS $AQN_STAGES $AQN_SIGMA_START"); done')
        env = {k: v for k, v in os.environ.items() if k not in ("AQN_STAGES", "AQN_SIGMA_START", "WARMUP_STEPS")}
        out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
        stages = {}
        for line in out.splitlines():
            steps, k, sigma = line.split()
            stages[int(steps)] = int(k)
            rollout = SimpleNamespace(aqn_sigma_start=float(sigma), total_steps=int(steps), aqn_stages=int(k))
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                warn_of_skipped_aqn_stages(rollout)
            assert not said or int(steps) == 1, (cfg.name, line, str(said[0].message))  # one step: noise-free alone
        assert stages[12] == (4 if cfg.name == "tiny.env" else 10) and stages[3] == 2, (cfg.name, stages)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_compare_aqn_reads_relative_paths_where_it_was_run(tmp_path):
    qerl = _recorder(tmp_path, "qerl", "exit 0\n")
    cwd = tmp_path / "here"
    cwd.mkdir()
    (cwd / "my.env").write_text((RECIPES / "configs" / "tiny.env").read_text())
    env = {**os.environ, "QERL": str(qerl), "SEEDS": "0", "PARALLEL": "1"}
    subprocess.run(["bash", str(RECIPES / "compare_aqn.sh"), "out", "my.env"], cwd=cwd, env=env, capture_output=True)
    logs = sorted(p.name for p in (cwd / "out").glob("*.log"))
    assert logs == ["bf16-lora-s0.log", "nvfp4-aqn-s0.log", "nvfp4-lora-s0.log", "shared-bf16.log", "shared-nvfp4.log"]
    assert "not found" not in (cwd / "out" / "nvfp4-lora-s0.log").read_text()
    assert not (ROOT / "out").exists()


@pytest.mark.skipif(shutil.which("nproc") is None, reason="needs GNU nproc")
@pytest.mark.parametrize("omp", ["1", "1000"])
def test_compare_aqn_runs_half_the_cores_whatever_omp_num_threads_says(tmp_path, omp):
    # PARALLEL's default was $(nproc) / 2, and GNU nproc prints OMP_NUM_THREADS when it is set: with
    # OMP_NUM_THREADS=1 (the README's advice on a shared machine) one loop at a time, with 1000 five hundred (s59r07)
    qerl = _recorder(tmp_path, "qerl", "exit 0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _recorder(bin_dir, "xargs", f'echo "$@" > {tmp_path / "xargs.args"}\n')  # the runs' xargs: its -P is PARALLEL
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT", "PARALLEL")}
    cores = int(subprocess.run(["nproc"], env=env, capture_output=True, text=True, check=True).stdout)
    env.update(QERL=str(qerl), SEEDS="0", STEPS="1", EVAL_EVERY="0", OMP_NUM_THREADS=omp,
               PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    subprocess.run(["bash", str(RECIPES / "compare_aqn.sh"), str(tmp_path / "out")], env=env, capture_output=True)
    args = (tmp_path / "xargs.args").read_text().split()
    assert args[args.index("-P") + 1] == str(max(cores // 2, 1)), (cores, args)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_compare_aqn_quantizes_and_scores_each_base_once(tmp_path):
    # Every NVFP4 run quantized the same checkpoint and every run scored its base policy again: 6 quantizes
    # and 9 base evals for 3 seeds (a 7B: 28 s each, its evals minutes). Now one of each per base format.
    log = tmp_path / "calls.log"
    qerl = _recorder(tmp_path, "qerl", f"""stage=$1; out=""
while [ $# -gt 0 ]; do if [ "$1" = --out ]; then out=$2; fi; shift; done
[ -n "$out" ] || exit 0
if [ -e "$out/manifest.json" ]; then echo "$stage already $out" >> {log}
else mkdir -p "$out"; echo "{{}}" > "$out/manifest.json"; echo "$stage made $out" >> {log}; fi
""")
    env = {**os.environ, "QERL": str(qerl), "SEEDS": "0 1", "PARALLEL": "1", "STEPS": "1", "EVAL_EVERY": "0"}
    out = tmp_path / "out"
    subprocess.run(["bash", str(RECIPES / "compare_aqn.sh"), str(out)], env=env, capture_output=True)
    calls = [line.split() for line in log.read_text().splitlines()]
    made = sorted((st, str(Path(o).relative_to(out))) for st, how, o in calls if how == "made" and st in ("quantize", "eval"))
    assert made == [("eval", "bf16-lora-s0/eval-final"), ("eval", "bf16-lora-s1/eval-final"),
                    ("eval", "nvfp4-aqn-s0/eval-final"), ("eval", "nvfp4-aqn-s1/eval-final"),
                    ("eval", "nvfp4-lora-s0/eval-final"), ("eval", "nvfp4-lora-s1/eval-final"),
                    ("eval", "shared-bf16/eval-base"), ("eval", "shared-nvfp4/eval-base"), ("quantize", "shared-nvfp4/base")]
    already = sorted(str(Path(o).relative_to(out)) for st, how, o in calls if how == "already")
    assert already == sorted([f"{v}-s{s}/eval-base" for v in ("bf16-lora", "nvfp4-aqn", "nvfp4-lora") for s in (0, 1)]
                             + [f"{v}-s{s}/base" for v in ("nvfp4-aqn", "nvfp4-lora") for s in (0, 1)])
    # hard links, not copies: a 32B base is 18 GB
    assert os.path.samefile(out / "nvfp4-aqn-s1" / "base" / "manifest.json", out / "shared-nvfp4" / "base" / "manifest.json")
    assert not (out / "bf16-lora-s0" / "base").exists()  # the 16-bit runs load the checkpoint itself
    # (review) the shared base redone (FORCE=1 after a change): a run that has taken no step links the new one,
    # a run with steps keeps the base its steps were made on
    shutil.rmtree(out / "shared-nvfp4" / "base")
    (out / "shared-nvfp4" / "base").mkdir()
    (out / "shared-nvfp4" / "base" / "manifest.json").write_text('{"new": 1}')
    for step in (out / "nvfp4-lora-s0").glob("step-*"):
        shutil.rmtree(step)
    subprocess.run(["bash", str(RECIPES / "compare_aqn.sh"), str(out)], env=env, capture_output=True)
    new = out / "shared-nvfp4" / "base" / "manifest.json"
    assert os.path.samefile(out / "nvfp4-lora-s0" / "base" / "manifest.json", new)
    assert not os.path.samefile(out / "nvfp4-aqn-s0" / "base" / "manifest.json", new)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_compare_aqn_rerun_keeps_the_first_runs_logs(tmp_path):
    # A rerun (after an interrupt, or to add EXTRA_AQN) truncated every run's log: the training output of the
    # finished runs was replaced by "already done" lines (a review)
    count = tmp_path / "n"
    qerl = _recorder(tmp_path, "qerl", f'n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}; '
                                       'echo "call $n: $1"\n')
    env = {**os.environ, "QERL": str(qerl), "SEEDS": "0", "PARALLEL": "1", "STEPS": "1", "EVAL_EVERY": "0"}
    out = tmp_path / "out"
    logs = ("bf16-lora-s0.log", "nvfp4-aqn-s0.log", "shared-nvfp4.log")
    subprocess.run(["bash", str(RECIPES / "compare_aqn.sh"), str(out)], env=env, capture_output=True)
    first = {log: (out / log).read_text() for log in logs}
    subprocess.run(["bash", str(RECIPES / "compare_aqn.sh"), str(out)], env=env, capture_output=True)
    for log in logs:
        assert "call " in first[log] and (out / log).read_text().startswith(first[log]), log
        assert len((out / log).read_text()) > len(first[log]), log


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_a_signal_to_compare_aqn_sh_stops_every_run(tmp_path, sig):
    # `kill <compare_aqn.sh pid>` stopped the script alone: xargs went on starting the remaining runs, and no
    # results were written (a review). The signal now reaches xargs and each running loop's stage. So does the
    # script's death by SIGKILL, as SIGTERM (xargs, and the runs it started, went on orphaned: a review).
    log = tmp_path / "calls.log"
    qerl = _recorder(tmp_path, "qerl", f"""echo "$1 $*" >> {log}
[ "$1" = rollout ] || exit 0
trap 'echo "rollout got TERM" >> {log}; exit 143' TERM
while [ "$SECONDS" -lt {PATIENCE} ]; do sleep 0.05; done; echo "rollout not signalled" >> {log}
""")
    env = {**os.environ, "QERL": str(qerl), "SEEDS": "0 1", "PARALLEL": "1", "STEPS": "1", "EVAL_EVERY": "0"}
    p = subprocess.Popen(["bash", str(RECIPES / "compare_aqn.sh"), str(tmp_path / "out")], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: _logged(log, "rollout"), "the first rollout to start")
        p.send_signal(sig)  # to the script alone, not its process group
        assert p.wait(timeout=PATIENCE) != 0
    finally:
        p.kill()
        _session_ends(p)  # an orphaned xargs would start the next run meanwhile
    rollouts = [x for x in log.read_text().splitlines() if x.startswith("rollout")]
    assert len(rollouts) == 2 and rollouts[1] == "rollout got TERM", rollouts


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
def test_a_signal_while_compare_aqn_sh_makes_the_shared_base_is_no_failure(tmp_path):
    # qerl_run_forwarding returned the stopped loop's 143, which compare_aqn.sh's `|| { echo FAILED ...; exit 1; }`
    # took for a failed base (a review): the script now ends as killed by the signal, once the loop has stopped.
    qerl, log = _signal_recorder(tmp_path)
    p = subprocess.Popen(["bash", str(RECIPES / "compare_aqn.sh"), str(tmp_path / "out")],
                         env={**os.environ, "QERL": str(qerl), "SEEDS": "0", "STEPS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(lambda: _logged(log), "the shared base's quantize to start")
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=PATIENCE)[0]
    finally:
        p.kill()
        _session_ends(p)
    assert p.returncode == -signal.SIGTERM and "FAILED" not in out, out
    assert log.read_text().splitlines()[1:] == ["quantize got TERM"]


def test_grpo_steps_0_makes_and_scores_the_base_only_and_slurm_refuses_it(tmp_path):
    log = tmp_path / "calls.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$1" >> {log}\n')
    env = {**os.environ, "QERL": str(qerl), "STEPS": "0"}
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(RECIPES / "configs" / "tiny.env"), str(tmp_path / "run")],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "STEPS=0" in r.stdout, r.stderr
    assert log.read_text().split() == ["quantize", "eval"]
    r = subprocess.run(["bash", str(RECIPES / "slurm" / "submit.sh"), str(RECIPES / "configs" / "tiny.env"),
                        str(tmp_path / "chain")], env={**env, "SBATCH": str(qerl)}, capture_output=True, text=True)
    assert r.returncode == 2 and "STEPS=0: nothing to chain" in r.stderr
    assert log.read_text().split() == ["quantize", "eval"]  # nothing submitted


def test_plot_compare_keeps_the_last_line_of_a_redone_step(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("plot_compare", RECIPES / "plot_compare.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    d = tmp_path / "nvfp4-lora-s0"
    (d / "merged").mkdir(parents=True)
    (d / "merged" / "manifest.json").write_text("{}")
    rows = [{"step": s, "entropy": e} for s, e in ((0, 9.0), (1, 9.0), (0, 1.0), (1, 2.0), (2, 3.0))]
    # and a line torn by a kill mid-append, which train-step keeps: it was a JSONDecodeError traceback
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "entr')
    train = pc.load(tmp_path)["nvfp4-lora"][0]["train"]
    assert [(r["step"], r["entropy"]) for r in train] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_plot_compare_leaves_out_a_run_whose_loop_has_not_finished(tmp_path):
    # An interrupted seed (2 of 4 steps, no eval-final) was counted in "seeds", its step-1 reward averaged
    # with the others' last-step reward, and the final pass@1 "mean over 3 seeds" was over 2 (a review).
    import json

    def run(name, rewards, final):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": r, "entropy": 0.1}) + "\n"
                                                 for i, r in enumerate(rewards)))
        for sub, v in (("eval-base", 0.41), ("eval-final", final)):
            if v is not None:
                (d / sub).mkdir()
                (d / sub / "metrics.json").write_text(json.dumps({"score": v}))
        if final is not None:
            (d / "merged").mkdir()
            (d / "merged" / "manifest.json").write_text("{}")

    run("bf16-lora-s0", [0.1, 0.2, 0.3, 0.9], 0.90)
    run("bf16-lora-s1", [0.1, 0.2, 0.3, 0.8], 0.80)
    run("bf16-lora-s2", [0.1, 0.2], None)
    # a finished run rerun with more steps (or FORCE=1) and stopped: its old merged/ is older than a step
    run("bf16-lora-s3", [0.1, 0.2, 0.3, 0.4, 0.5], 0.95)
    (tmp_path / "bf16-lora-s3" / "merged" / "manifest.json").write_text(json.dumps({"created": "2026-11-27T10:00:00Z"}))
    (tmp_path / "bf16-lora-s3" / "step-000004" / "adapter").mkdir(parents=True)
    (tmp_path / "bf16-lora-s3" / "step-000004" / "adapter" / "manifest.json").write_text(
        json.dumps({"created": "2026-11-27T11:00:00Z"}))
    r = subprocess.run([sys.executable, str(RECIPES / "plot_compare.py"), str(tmp_path)], capture_output=True, text=True)
    row = next(line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| bf16-lora"))
    assert row.split("|")[2].strip() == "2" and "| 0.850 |" in row, row
    assert "bf16-lora-s2 is left out" in r.stderr
    assert "bf16-lora-s3 is left out: its loop has not finished (step-000004 is newer than merged/)" in r.stderr


def test_plotting_without_matplotlib_says_what_to_install(tmp_path):
    import json
    import sys

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5, "entropy": 1.0}) + "\n")
    code = (f"import sys, runpy; sys.modules['matplotlib'] = None; sys.argv = ['plot_run.py', {str(run)!r}]\n"
            f"runpy.run_path({str(RECIPES / 'plot_run.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1 and "pip install 'qerl[plot]'" in r.stderr and "Traceback" not in r.stderr, r.stderr


_CHILD = """
import signal, sys, time
from qerl_cli import cli
signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "w").write("term"), sys.exit(0)))
signal.signal(signal.SIGWINCH, lambda *a: open(sys.argv[3], "w").write("alive"))  # the test's probe
cli._stop_with_parent()
open(sys.argv[2], "w").write("ready")
time.sleep(30)
"""
_PARENT = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], start_new_session=True)
print(p.pid, flush=True)
p.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("on", [True, False], ids=["QERL_STOP_WITH_PARENT=1", "unset"])
def test_a_stage_in_its_own_group_stops_when_grpo_sh_dies(tmp_path, on):
    # grpo.sh runs each stage in a process group of its own (a signal reaches it once); a SIGKILL of
    # the script's group then left the stage running, still writing (a review). With the variable the
    # stage is sent SIGTERM when its parent dies; without it (a stage started by hand) it runs on.
    # Without the variable, no SIGTERM is what to show: the kernel has sent the death signal once the dead parent
    # is reaped, and a SIGWINCH probe sent after it is handled after any SIGTERM (Python runs the handlers of pending
    # signals by number), so the probe's file tells that the child has seen every signal it got (where 1.5 s of
    # polls for no file passed whatever happened on a loaded machine).
    term, ready, probed = tmp_path / "term", tmp_path / "ready", tmp_path / "probed"
    env = {k: v for k, v in os.environ.items() if k != "QERL_STOP_WITH_PARENT"}
    if on:
        env["QERL_STOP_WITH_PARENT"] = "1"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, str(term), str(ready), str(probed)], env=env,
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        _wait_for(ready.exists, "the child to set its death signal")
        parent.kill()
        parent.wait()
        if on:
            _wait_for(term.exists, "the child's SIGTERM")
        else:
            os.kill(child, signal.SIGWINCH)
            _wait_for(lambda: probed.exists() or term.exists(), "the child to handle the probe")
        assert term.exists() == on
    finally:
        try:
            os.kill(child, signal.SIGKILL)  # the child this test started, if it still runs
        except ProcessLookupError:
            pass


def test_a_second_sigterm_does_not_cut_the_clean_up_short():
    # grpo.sh passes SIGTERM on to the stage; a kill of the whole group sends it one too. The second
    # raised Terminated again inside the clean-up the first had started.
    from qerl_cli import cli

    old = signal.getsignal(signal.SIGTERM)
    try:
        with cli._stage_signals():
            with pytest.raises(cli.Terminated):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs here
            os.kill(os.getpid(), signal.SIGTERM)  # ignored while the stage cleans up
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert signal.getsignal(signal.SIGTERM) == old  # the stage's handling ends with it


def test_qerl_may_be_a_wrapper_command(tmp_path):
    # QERL="apptainer exec img.sif qerl" (a container on a cluster) ran as one file name, not found.
    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$WRAPPED $1" >> {log}\n')
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\nEVAL_DATASET=\n")
    env = {**os.environ, "QERL": f"env WRAPPED=yes {qerl}"}
    subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")], env=env, check=True,
                   capture_output=True)
    assert log.read_text().split("\n")[:4] == ["yes quantize", "yes rollout", "yes train-step", "yes merge"]
    log.unlink()
    subprocess.run(["bash", str(RECIPES / "slurm" / "stage.sbatch"), "rollout", str(cfg), str(tmp_path / "run"), "0"],
                   env={**env, "SLURM_ARRAY_TASK_ID": "0"}, check=True, capture_output=True)
    assert log.read_text() == "yes rollout\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stage_whose_live_parent_is_pid_1_runs(monkeypatch):
    # grpo.sh as a container's entrypoint is PID 1, alive: the stage took "parent is PID 1" for "parent
    # died", stopped itself at once (exit 143) and left SIGTERM ignored for the rest of the process.
    from qerl_cli import cli

    monkeypatch.setenv("QERL_STOP_WITH_PARENT", "1")
    monkeypatch.setattr(os, "getppid", lambda: 1)
    old = signal.getsignal(signal.SIGTERM)
    with cli._stage_signals():
        time.sleep(0.05)  # a self-sent SIGTERM would raise here
    assert signal.getsignal(signal.SIGTERM) == old


def _quickstart(tmp_path, pip_rc: int, pythonpath: Path | None = None, **env_extra):
    """quickstart.sh with STEPS=0 on a PATH of stand-ins (tmp_path/bin, then /usr/bin:/bin): a `python` that
    logs `pip` calls and answers them with ``pip_rc``, else runs this Python with ``pythonpath`` (what
    `import qerl_cli` finds outside the repository). Returns (the run, the pip log)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "python.log"
    bin_dir.mkdir(exist_ok=True)
    path_env = f"PYTHONPATH={pythonpath} " if pythonpath else ""
    _recorder(bin_dir, "python", f'if [ "$1 $2" = "-m pip" ]; then echo "$*" >> {log}; exit {pip_rc}; fi\n'
                                 f'{path_env}exec {sys.executable} "$@"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("QERL", "PYTHONPATH")}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", STEPS="0", EVAL_DATASET="", **env_extra)
    proc = subprocess.run(["bash", str(RECIPES / "quickstart.sh"), str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, log


def _stub_package(root: Path, body: str) -> Path:
    (root / "qerl_cli").mkdir(parents=True)
    (root / "qerl_cli" / "__init__.py").write_text(body)
    return root


def test_quickstart_installs_the_project_when_the_qerl_command_is_missing(tmp_path):
    # In the repository root `python -c "import qerl_cli"` finds the source tree, so on a machine with torch and
    # matplotlib but without qerl installed the quickstart skipped its install and grpo.sh stopped at its first
    # stage: "qerl: command not found", exit 127 (a review, 2026-11-27).
    proc, log = _quickstart(tmp_path, pip_rc=0)
    assert shutil.which("qerl", path=f"{tmp_path / 'bin'}:/usr/bin:/bin") is None
    assert log.exists() and "install -q -e .[plot]" in log.read_text(), (proc.returncode, proc.stderr[-2000:])


def test_quickstart_with_qerl_set_installs_nothing_when_matplotlib_is_there(tmp_path):
    # QERL="python -m qerl_cli" runs the stages from the repository root without the `qerl` command; the check above
    # sent such a machine (qerl_cli not installed: simulated by a stub that fails to import outside the root)
    # to `pip install -e` before any stage, which fails offline. The stages still import qerl_kernels, which only an
    # install or a PYTHONPATH link names: the stub's link here. The test relied on the machine's own install for it
    # and failed where that install is another tree, or stale, and a PYTHONPATH link (which it drops) is used.
    stub = _stub_package(tmp_path / "stub", "raise ImportError('not installed')\n")
    (stub / "qerl_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    proc, log = _quickstart(tmp_path, pip_rc=1, pythonpath=stub, QERL="python -m qerl_cli")
    assert not log.exists(), log.read_text()
    assert (tmp_path / "run" / "base" / "manifest.json").exists(), (proc.returncode, proc.stderr[-2000:])
    # STEPS=0 makes no step to plot: plot_run.py's "metrics.jsonl not found" ended the script with exit 1
    assert proc.returncode == 0 and "no RL steps (STEPS=0)" in proc.stdout, proc.stderr[-2000:]


def test_quickstart_names_an_installed_qerl_from_another_checkout(tmp_path):
    # The `qerl` command ran whatever checkout was installed: a quickstart from a fresh clone ran another tree's
    # code without a word (a review). It now says which tree runs.
    other = _stub_package(tmp_path / "other", "")
    (tmp_path / "bin").mkdir()
    _recorder(tmp_path / "bin", "qerl", "exit 0\n")
    proc, _ = _quickstart(tmp_path, pip_rc=1, pythonpath=other)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"note: the qerl command runs the checkout installed at {os.path.realpath(other)}" in proc.stderr
    # QERL='python -m qerl_cli', once named as a way to run this one, runs the installed tree's qerl_kernels with it
    assert "python -m qerl_cli" not in proc.stderr, proc.stderr


def test_a_run_dir_with_a_leading_dash_is_not_read_as_an_option(tmp_path):
    # RUN_DIR "-rd" ended grpo.sh at `mkdir: invalid option -- 'r'` and, made, at eval --compare's "No such option: -r"
    lib = RECIPES / "lib.sh"
    out = subprocess.run(["bash", "-c", f'source "{lib}"; BASE_FORMAT=nvfp4; qerl_set_base -rd; mkdir -p "$RUN_DIR";'
                          ' qerl_compare_cmd; printf "%s\\n" "$RUN_DIR" "$BASE" "${QERL_CMD[@]}"'],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:5] == ["./-rd", "./-rd/base", "eval", "--compare", "./-rd/eval-base"]
    assert (tmp_path / "-rd").is_dir()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@needs_proc
@pytest.mark.parametrize("sig, stage_gets, rc", [
    (signal.SIGTERM, "TERM", -signal.SIGTERM), (signal.SIGINT, "INT", -signal.SIGINT),
    (signal.SIGKILL, "TERM", -signal.SIGKILL), (signal.SIGQUIT, "TERM", 143)], ids=["TERM", "INT", "KILL", "QUIT"])
def test_a_signal_to_quickstart_sh_stops_the_loop(tmp_path, sig, stage_gets, rc):
    # `kill <quickstart.sh pid>` stopped quickstart.sh alone: bash passes no signal to a foreground child, so
    # grpo.sh ran the rest of the loop orphaned, still writing (a review). The signal now reaches the loop,
    # whose running stage (a stand-in that records it) stops; quickstart.sh ends as the loop did: killed by it.
    # SIGKILL, which no script can pass on, left the loop running too, on to its next stages (a review): the loop
    # gets SIGTERM when the script dies, and its stage with it. Ctrl-\ (SIGQUIT, which bash ignores) reached no
    # stage at all: passed on as SIGTERM, the script then exits as the loop did (143).
    qerl, log = _signal_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "STEPS": "2", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    # (once every process it started has ended: an orphaned loop would have started its next stage)
    assert _signal_once_started(["bash", str(RECIPES / "quickstart.sh"), str(tmp_path / "run")], env, log, sig) == rc
    lines = log.read_text().splitlines()
    assert [x.split()[0] for x in lines] == ["quantize", "quantize"] and lines[1] == f"quantize got {stage_gets}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@needs_proc
@pytest.mark.parametrize("tool", ["setpriv", "python3"])
def test_a_command_run_forwarding_gets_sigterm_when_the_script_dies(tmp_path, tool):
    # Each way lib.sh sets the death signal (util-linux's setpriv; python3 where setpriv has no --pdeathsig, as on
    # RHEL 8): the script SIGKILLed, its command gets SIGTERM; a command whose script died before the death signal
    # was set (re-parented: no signal would come) does not run.
    if tool == "setpriv" and "--pdeathsig" not in subprocess.run(["setpriv", "--help"], capture_output=True,
                                                                   text=True).stdout:
        pytest.skip("no setpriv --pdeathsig here")
    mark, ready = tmp_path / "mark", tmp_path / "ready"
    cmd = (f"trap 'echo got TERM >> {mark}; exit 143' TERM; echo $$ > {ready}; "
           f'while [ "$SECONDS" -lt {PATIENCE} ]; do sleep 0.05; done; echo ran on >> {mark}')
    script = f'source {RECIPES / "lib.sh"}; _qerl_death_tool={tool}; qerl_run_forwarding bash -c "$1"'
    p = subprocess.Popen(["bash", "-c", script, "script", cmd], start_new_session=True)
    try:
        _wait_for(lambda: _logged(ready), "the command to start")
        p.kill()
        p.wait()
        _wait_for(mark.exists, "the command to end")
        assert mark.read_text() == "got TERM\n"
    finally:
        p.kill()
        _session_ends(p)
    r = subprocess.run(["bash", "-c", f'source {RECIPES / "lib.sh"}; _qerl_death_tool={tool}; '
                        f'(_qerl_exec_stopping_with 1 echo ran)'], capture_output=True, text=True)  # 1: not its parent
    assert (r.returncode, r.stdout) == (143, "")


@needs_proc
def test_ctrl_z_stops_the_running_stage_too_and_fg_resumes_it(tmp_path):
    # Ctrl-Z stopped quickstart.sh (the terminal's foreground group) and not the loop in a group of its own: the
    # stage ran on while the script sat stopped. SIGTSTP now goes down the chain (quickstart.sh -> grpo.sh ->
    # stage), and SIGCONT (`fg`) after it.
    qerl, log = _signal_recorder(tmp_path)
    env = {**os.environ, "QERL": str(qerl), "STEPS": "2", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen(["bash", str(RECIPES / "quickstart.sh"), str(tmp_path / "run")], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # a foreground job

    def state(pid):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    try:
        stage = int(_wait_for(lambda: _logged(log) and log.read_text(), "the first stage to log itself").split()[1])
        os.killpg(p.pid, signal.SIGTSTP)  # Ctrl-Z
        _wait_for(lambda: (state(p.pid), state(stage)) == ("T", "T"), "the script and its stage to stop")
        os.killpg(p.pid, signal.SIGCONT)  # fg
        _wait_for(lambda: "T" not in (state(p.pid), state(stage)), "the script and its stage to resume")
        p.terminate()
        assert p.wait(timeout=PATIENCE) == -signal.SIGTERM
        assert log.read_text().splitlines()[1:] == ["quantize got TERM"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        _session_ends(p)


def test_a_job_rerun_alone_names_a_force_of_the_environment_it_does_not_use(tmp_path):
    # FORCE=1 in the environment of a job rerun alone (after editing submit.env) was silently the chain's FORCE=0:
    # the stage refused with "pass --force", and the note naming the environment's unused settings left FORCE out.
    cfg, run = _submit_7b_chain(tmp_path)
    qerl, _ = _argv_recorder(tmp_path)
    cmd = ["bash", str(RECIPES / "slurm" / "stage.sbatch"), "train", str(cfg), str(run), "0"]
    err = subprocess.run(cmd, env={**os.environ, "QERL": str(qerl), "FORCE": "1"}, check=True, capture_output=True,
                         text=True).stderr
    assert "FORCE differ" in err, err


def _forced_rerun_with_fewer_steps(run: Path, rerun_steps: int = 2, rerun_made: int = 2) -> None:
    """A run dir as `STEPS=3 grpo.sh` then `FORCE=1 STEPS=2 LR=... grpo.sh` leave it (EVAL_EVERY=1), its manifests
    hashed by qerl's own functions: steps 0-1 and step 0's eval redone, the first run's step 2, step 1's eval (the
    rerun does not score step 1: the merged policy is its last) and metrics lines left behind. ``rerun_steps`` and
    ``rerun_made``: the rerun's STEPS and the steps it made before it stopped (no merge then)."""
    import json

    from qerl_cli.adapters import adapter_hash
    from qerl_cli.hashing import sha256_file
    from qerl_cli.train_step import _adapter_inputs_hash

    def adapter(s, total, tag):
        d = run / f"step-{s:06d}" / "adapter"
        before = run / f"step-{s - 1:06d}" / "adapter"
        inputs = {"model": "b", "shards": tag, **({"adapter": _adapter_inputs_hash(before)} if s else {})}
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "trainer_state.json"):
            (d / name).write_text(f"{name} {tag} {s}")
        outputs = {p.name: sha256_file(p) for p in d.iterdir()}
        (d / "manifest.json").write_text(json.dumps({"stage": "train-step", "config": {"total_steps": total},
                                                     "inputs": inputs, "outputs": outputs}))

    def evaluate(out, score, **inputs):
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({"score": score}))
        (out / "manifest.json").write_text(json.dumps({"stage": "eval", "inputs": inputs, "outputs": {}}))

    rows = []
    for total, made, tag, reward in ((3, 3, "first", 0.9), (rerun_steps, rerun_made, "rerun", 0.2)):
        for s in range(made):
            adapter(s, total, tag)
            rows.append({"step": s, "reward_mean": reward + s / 100, "entropy": 1.0})
            if s + 1 < total:
                evaluate(run / f"step-{s:06d}" / "eval", reward, adapter=adapter_hash(run / f"step-{s:06d}" / "adapter"))
        if made < total:
            break
        (run / "merged").mkdir(exist_ok=True)
        (run / "merged" / "manifest.json").write_text(json.dumps({
            "stage": "merge", "created": "2026-11-27T12:00:00Z", "outputs": {},
            "inputs": {"model": "b", "adapter": adapter_hash(run / f"step-{total - 1:06d}" / "adapter")}}))
        evaluate(run / "eval-final", reward + 0.05, model=tag)
    evaluate(run / "eval-base", 0.1, model="b")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_run_shows_only_the_steps_of_the_run_that_made_them(tmp_path):
    # FORCE=1 STEPS=2 over a finished STEPS=3 run: its table showed the first run's step 2 (reward 0.92) as this
    # run's, its step-1 eval of the first run's adapter as "after step 1", and put eval-final after step 2.
    run = tmp_path / "run"
    _forced_rerun_with_fewer_steps(run)
    r = subprocess.run([sys.executable, str(RECIPES / "plot_run.py"), str(run)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [["0", "0.200", "1.000"], ["1", "0.210", "1.000"]], r.stdout
    evals = [line for line in r.stdout.splitlines() if line.startswith("pass@1")]
    assert evals == ["pass@1 of the base policy: 10.0%", "pass@1 after step   0: 20.0%", "pass@1 after step   1: 25.0%"]
    assert "left out step-000002: not made by the run of steps 0-1" in r.stderr
    assert "step-000001/eval is left out: it scored an earlier run's adapter" in r.stderr
    assert (run / "step-000002" / "adapter" / "manifest.json").exists()  # left where it was: not deleted


def test_plot_run_leaves_out_a_merge_of_an_earlier_run_and_keeps_a_run_without_manifests(tmp_path):
    import json

    run = tmp_path / "run"
    _forced_rerun_with_fewer_steps(run)
    # A rerun stopped before its merge: merged/ and eval-final/ are still the first run's (of its step 2).
    merged = json.loads((run / "merged" / "manifest.json").read_text())
    merged["inputs"]["adapter"] = "0" * 64
    (run / "merged" / "manifest.json").write_text(json.dumps(merged))
    r = subprocess.run([sys.executable, str(RECIPES / "plot_run.py"), str(run)], capture_output=True, text=True)
    assert r.returncode == 0 and "after step   1" not in r.stdout, r.stdout
    assert "eval-final is left out: merged/ was not made from this run's steps" in r.stderr
    # Where no manifest tells (a hand-made dir, step directories deleted to free space), every line counts, as before.
    for d in run.glob("**/manifest.json"):
        d.unlink()
    r = subprocess.run([sys.executable, str(RECIPES / "plot_run.py"), str(run)], capture_output=True, text=True)
    assert r.returncode == 0 and "    2    0.920" in r.stdout and "after step   2: 25.0%" in r.stdout, r.stdout


def test_plot_run_shows_a_forced_rerun_stopped_midway_up_to_where_it_got(tmp_path):
    # FORCE=1 (LR changed, the same STEPS=3) stopped after step 1: step 2, its merge and eval-final are the first
    # run's, and they descend from its step 1, not this run's.
    run = tmp_path / "run"
    _forced_rerun_with_fewer_steps(run, rerun_steps=3, rerun_made=2)
    r = subprocess.run([sys.executable, str(RECIPES / "plot_run.py"), str(run)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line.split()[:2] for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [["0", "0.200"], ["1", "0.210"]], r.stdout
    assert [line for line in r.stdout.splitlines() if line.startswith("pass@1 after")] == [
        "pass@1 after step   0: 20.0%", "pass@1 after step   1: 20.0%"]
    assert "eval-final is left out" in r.stderr


def test_plot_compare_counts_only_the_steps_of_the_run_that_made_them(tmp_path):
    # compare_aqn.sh rerun with FORCE=1 and fewer STEPS: "last-step reward" was the first run's step 2 (0.920).
    _forced_rerun_with_fewer_steps(tmp_path / "nvfp4-lora-s0")
    r = subprocess.run([sys.executable, str(RECIPES / "plot_compare.py"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    row = next(line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| nvfp4-lora"))
    assert "| 0.210 |" in row and "25.0" in row, row


def test_grpo_sh_names_the_steps_an_earlier_longer_run_left_and_keeps_them(tmp_path):
    # FORCE=1 with fewer STEPS redoes steps 0..STEPS-1 and never touches the later ones: the loop says so at its end.
    qerl = _recorder(tmp_path, "qerl", "true\n")
    run = tmp_path / "run"
    for s in (2, 3):
        (run / f"step-{s:06d}" / "adapter").mkdir(parents=True)
    env = {**os.environ, "QERL": str(qerl), "STEPS": "2", "FORCE": "1"}
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(RECIPES / "configs" / "tiny.env"), str(run)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"note: {run} keeps step-000002 .. step-000003 (at or past STEPS=2) from an earlier, longer run" in r.stderr
    assert (run / "step-000003" / "adapter").is_dir()
    r = subprocess.run(["bash", str(RECIPES / "grpo.sh"), str(RECIPES / "configs" / "tiny.env"), str(run)],
                       env={**env, "STEPS": "4"}, capture_output=True, text=True)
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
@needs_proc
def test_timeout_around_grpo_sh_stops_the_stage(tmp_path):
    # `timeout N bash grpo.sh` (and systemd's stop) sends SIGTERM and at once SIGCONT: bash ran the trap of the
    # CONT alone (both came in one `wait`), the TERM was lost and the loop ran on to its end past the timeout (a
    # review). SIGCONT is not trapped now: `fg` resumes the stage from the Ctrl-Z handler itself.
    # The timeout expires once the stage runs: coreutils' timeout takes a SIGALRM for its own alarm (`timeout 2` and
    # a check that it ended within 6 s failed on a loaded machine, the TERM sent before the stage had started).
    qerl, log = _signal_recorder(tmp_path)
    p = subprocess.Popen(["timeout", str(PATIENCE), "bash", str(RECIPES / "grpo.sh"), str(_grpo_cfg(tmp_path)),
                          str(tmp_path / "run")], env={**os.environ, "QERL": str(qerl)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: _logged(log), "the first stage to log itself")
        p.send_signal(signal.SIGALRM)
        assert p.wait(timeout=PATIENCE) == 124
    finally:
        p.kill()
        _session_ends(p)  # a loop that ran on past the timeout
    assert log.read_text().splitlines()[1:] == ["quantize got TERM"]


@pytest.mark.parametrize("tool", ["setpriv", "python3", "none"])
def test_a_shell_function_runs_through_qerl_run_forwarding(tmp_path, tool):
    # A user script's function, or an exported function named in QERL: exec found no such command (exit 127), or ran
    # the file of that name on PATH instead (an installed `qerl` where QERL=qerl named a wrapping function).
    script = (f'source {RECIPES / "lib.sh"}; _qerl_death_tool={tool}; f() {{ echo "f ran: $*"; return 3; }}; '
              'qerl_run_forwarding f a "b c"; echo "rc=$?"')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
    assert r.stdout == "f ran: a b c\nrc=3\n", r.stderr
    log = tmp_path / "qerl.log"
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\nEVAL_DATASET=\n")
    subprocess.run(["bash", "-c", f'myqerl() {{ echo "fn $1" >> {log}; }}; export -f myqerl; '
                    f'bash {RECIPES / "grpo.sh"} {cfg} {tmp_path / "run"}'], env={**os.environ, "QERL": "myqerl"},
                   check=True, capture_output=True)
    assert log.read_text().splitlines() == ["fn quantize", "fn rollout", "fn train-step", "fn merge"]


@pytest.mark.parametrize("scripts_trap", ["", 'trap "echo clean-up; exit 9" TERM; '])
def test_qerl_run_forwarding_in_a_subshell_ends_that_subshell_alone(tmp_path, scripts_trap):
    # `qerl_run_forwarding CMD &` (or `| tee`) in a user script: after a signal it killed $$, the script itself,
    # not the subshell that ran it. And `trap -p` in a subshell shows the parent's traps, which do not run there:
    # put back after CMD, the script's trap ran in the subshell (its clean-up twice, the subshell's status its 9).
    # The subshell is signalled once CMD runs (a `sleep 0.5` before the kill found it still starting when loaded).
    ready = tmp_path / "ready"
    script = (f'source {RECIPES / "lib.sh"}; {scripts_trap}(qerl_run_forwarding sh -c "touch {ready}; sleep {PATIENCE}") '
              f'& p=$!; until [ -e {ready} ]; do sleep 0.05; done; '
              'kill -TERM $p; wait $p; echo "the script goes on: $?"')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=PATIENCE)
    assert (r.returncode, r.stdout) == (0, "the script goes on: 143\n"), r.stderr


def test_qerl_run_forwarding_keeps_the_callers_traps(tmp_path):
    # A user script sourcing lib.sh with its own TERM trap: it was gone after the call, and after a signal the
    # script died without running it.
    lib = RECIPES / "lib.sh"
    r = subprocess.run(["bash", "-c", f'source {lib}; trap "echo mine" TERM; qerl_run_forwarding true; trap -p TERM'],
                       capture_output=True, text=True, timeout=10)
    assert r.stdout == "trap -- 'echo mine' SIGTERM\n"
    ready = tmp_path / "ready"
    script = f'source {lib}; trap "echo clean-up; exit 9" TERM; qerl_run_forwarding sh -c "touch {ready}; sleep {PATIENCE}"'
    p = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(ready.exists, "the command to start")  # a `sleep 0.5` found the script still starting when loaded
        p.terminate()
        assert p.wait(timeout=PATIENCE) == 9 and p.stdout.read() == "clean-up\n"
    finally:
        p.kill()


def _plot_printing(script: str, arg, printed: str) -> subprocess.CompletedProcess:
    """Run recipes/SCRIPT ARG headless, each figure's savefig replaced by ``print(PRINTED)`` (an expression of
    ``self``, the figure): what the plot would draw, as text."""
    code = ("import runpy, sys, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.figure as f\n"
            f"f.Figure.savefig = lambda self, *a, **k: print({printed})\n"
            f"sys.argv = [{script!r}, {str(arg)!r}]\n"
            f"runpy.run_path({str(RECIPES / script)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_plot_run_labels_the_pass1_axis_as_steps_taken(tmp_path):
    # The table says "pass@1 after step 4" (steps count from 0) and the plot put that point at 5 under the label
    # "adapter after step", which named step 5 (a review, 2026-11-27): the axis counts the steps taken.
    run = tmp_path / "run"
    _forced_rerun_with_fewer_steps(run, rerun_steps=3, rerun_made=3)
    r = _plot_printing("plot_run.py", run, "'XLABEL', self.axes[2].get_xlabel(), "
                                           "[round(x) for x in self.axes[2].lines[0].get_xdata()]")
    assert r.returncode == 0, r.stderr
    assert "pass@1 after step   0: 20.0%" in r.stdout
    assert "XLABEL RL steps taken (0 = the base policy) [0, 1, 2, 3]" in r.stdout, r.stdout


def test_plot_compare_names_as_many_first_steps_as_the_runs_have(tmp_path):
    # results.md said "mean entropy, first 3 steps" over a STEPS=2 comparison (a review)
    import json

    for v in ("nvfp4-lora", "nvfp4-aqn"):
        d = tmp_path / f"{v}-s0"
        (d / "merged").mkdir(parents=True)
        (d / "merged" / "manifest.json").write_text("{}")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "entropy": e, "reward_mean": 0.5}) + "\n"
                                                 for s, e in ((0, 1.0), (1, 2.0))))
    r = subprocess.run([sys.executable, str(RECIPES / "plot_compare.py"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "results.md").read_text()
    assert "mean entropy, first 2 steps |" in table and "| 1.500 |" in table, table


def _finished_compare_run(d, rows):
    import json

    (d / "merged").mkdir(parents=True)
    (d / "merged" / "manifest.json").write_text("{}")
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plots_show_a_value_that_is_not_a_number_as_missing(tmp_path):
    # train-step writes a non-finite metric as null (an older qerl's reward mean of 1e308s overflowed to one):
    # plot_run's table and plot_compare's means over seeds formatted / summed the None, a traceback (a review).
    rows = [{"step": 0, "reward_mean": 0.5, "entropy": 1.2}, {"step": 1, "reward_mean": None, "entropy": 1.1},
            {"step": 2, "reward_mean": 0.7, "entropy": float("nan")}]
    _finished_compare_run(tmp_path / "nvfp4-lora-s0", rows)
    env = {**os.environ, "MPLBACKEND": "Agg"}
    r = subprocess.run([sys.executable, str(RECIPES / "plot_run.py"), str(tmp_path / "nvfp4-lora-s0")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [line.split() for line in r.stdout.splitlines() if line.strip()[:1].isdigit()] == [
        ["0", "0.500", "1.200"], ["1", "n/a", "1.100"], ["2", "0.700", "n/a"]], r.stdout
    assert (tmp_path / "nvfp4-lora-s0" / "curves.png").stat().st_size > 1000
    _finished_compare_run(tmp_path / "nvfp4-lora-s1", [dict(x, reward_mean=None) for x in rows])
    r = subprocess.run([sys.executable, str(RECIPES / "plot_compare.py"), str(tmp_path)], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    row = next(line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| nvfp4-lora"))
    assert row.endswith("| 0.700 | 1.150 |"), row  # the numbers there are, over seeds and steps
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_plot_compare_averages_the_seeds_step_by_step(tmp_path):
    # A seed whose metrics.jsonl lacks step 1's line: the curve's point "step 1" was the mean of seed 0's step 1
    # and seed 1's step 2 (lines taken by position), and "first 3 steps" read seed 1's step 3 (a review).
    _finished_compare_run(tmp_path / "nvfp4-lora-s0", [{"step": s, "reward_mean": s / 10, "entropy": 1.0}
                                                       for s in range(4)])
    _finished_compare_run(tmp_path / "nvfp4-lora-s1", [{"step": s, "reward_mean": 0.5 + s / 10, "entropy": e}
                                                       for s, e in ((0, 1.0), (2, 1.0), (3, 9.0))])
    r = _plot_printing("plot_compare.py", tmp_path, "'MEAN', [float(x) for x in self.axes[0].lines[0].get_xdata()], "
                                                    "[round(float(y), 3) for y in self.axes[0].lines[0].get_ydata()]")
    assert r.returncode == 0, r.stderr
    assert "MEAN [0.0, 2.0, 3.0] [0.25, 0.45, 0.55]" in r.stdout, r.stdout
    table = (tmp_path / "results.md").read_text()
    assert "mean entropy, first 3 steps |" in table and table.rstrip().endswith("| 0.550 | 1.000 |"), table


@pytest.mark.parametrize("script", ["grpo.sh", "slurm/submit.sh", "quickstart.sh", "compare_aqn.sh", "slurm/stage.sbatch"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_scripts_usage_and_starts_nothing(tmp_path, script, flag):
    # grpo.sh and submit.sh said "error: config --help not found" (exit 2); quickstart.sh and compare_aqn.sh
    # started a run in a directory named --help; stage.sbatch said "line 12: 2: config" (exit 1)
    env = {**os.environ, "QERL": "false", "SBATCH": "false"}
    r = subprocess.run(["bash", str(RECIPES / script), flag], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    usage = "sbatch [opts] recipes/slurm/stage.sbatch STAGE" if script.endswith(".sbatch") else f"bash recipes/{script}"
    assert usage in r.stdout and not r.stdout.lstrip().startswith(("#", "!"))
    assert "set -euo" not in r.stdout and "shellcheck" not in r.stdout and "SBATCH --" not in r.stdout
    assert list(tmp_path.iterdir()) == [] and not (RECIPES.parent / "runs" / flag).exists()


@pytest.mark.parametrize("script", ["grpo.sh", "slurm/submit.sh"])
def test_a_config_path_starting_with_a_dash_is_a_config(tmp_path, script):
    # Only -h and --help ask for the usage; a config "-c.env" ended in "source: -c: invalid option" (exit 2).
    qerl, log = _argv_recorder(tmp_path)
    sbatch, sbatch_log = _fake_sbatch(tmp_path)
    (tmp_path / "-c.env").write_text((RECIPES / "configs" / "qwen2.5-7b-instruct.env").read_text()
                                     + "\nWARMUP_STEPS=0\nSTEPS=1\nEVAL_DATASET=\n")
    env = {**os.environ, "QERL": str(qerl), "SBATCH": str(sbatch)}
    r = subprocess.run(["bash", str(RECIPES / script), "-c.env"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (log if script == "grpo.sh" else sbatch_log).exists() and (tmp_path / "runs" / "-c").is_dir()
