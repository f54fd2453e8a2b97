"""Stage flags and training host checks that survived mutation testing (round 6, 2026-11-27).

Covers: what each stage's flags put into its config (``qerl eval``, ``merge``, ``quantize`` and
``train-step``: the CLI defaults are the config's defaults, and every flag reaches its field), the
lines each command prints (already done, ``-q``, the merge summary), and host-side checks of the
training pieces, the checkpoint reader, the synthetic task, the engine's model runner and the
compile workers. The stage functions are replaced by recorders, so no model is loaded for the flag
tests; each checks what a user would see if the flag were dropped or its default changed.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from qerl_cli.cli import app


def _invoke(args: list[str]):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


# ---- qerl eval -------------------------------------------------------------------------------------
@pytest.fixture
def eval_calls(monkeypatch):
    """``qerl eval`` with ``evaluate`` recorded: calls[i] is the EvalConfig; ``done`` sets already_done."""
    import qerl_cli.evaluate as ev

    calls = SimpleNamespace(cfgs=[], done=False)

    def fake(cfg, console=None):
        calls.cfgs.append(cfg)
        return {"already_done": calls.done, "metrics": {}}

    monkeypatch.setattr(ev, "evaluate", fake)
    monkeypatch.setattr(ev, "render_metrics", lambda metrics, console: console.print("THE-TABLE"))
    monkeypatch.setattr(ev, "result_line", lambda metrics, out, done=False: f"THE-RESULT done={done}")
    return calls


def test_eval_flag_defaults_are_the_configs(eval_calls, tmp_path):
    from qerl_cli.evaluate import EvalConfig

    m, d, o = tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o"
    r = _invoke(["eval", "--model", m, "--dataset", d, "--out", o])
    assert r.exit_code == 0, r.output
    assert eval_calls.cfgs == [EvalConfig(model=m, dataset=d, out=o)]


def test_eval_flags_reach_the_config(eval_calls, tmp_path):
    tpl = tmp_path / "chat.jinja"
    args = ["eval", "--model", tmp_path / "m", "--dataset", tmp_path / "d.jsonl", "--out", tmp_path / "o",
            "--adapter", tmp_path / "a", "--k", "4", "--num-samples", "8", "--temperature", "0.7", "--top-p", "0.9",
            "--max-new-tokens", "77", "--stop", "\nQ:", "--stop", "END", "--prompt-template", "{prompt}!",
            "--system-prompt", "be brief", "--chat-template-file", tpl, "--chat-template-kwargs", '{"enable_thinking": false}',
            "--scorer", "math", "--max-problems", "5",
            "--engine", "native", "--device", "cpu", "--dtype", "fp32", "--seed", "3", "--max-num-seqs", "9",
            "--max-model-len", "333", "--allow-base-mismatch", "--force", "-q"]
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    (cfg,) = eval_calls.cfgs
    assert (cfg.adapter, cfg.k, cfg.num_samples, cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.stop) == (
        tmp_path / "a", 4, 8, 0.7, 0.9, 77, ("\nQ:", "END"))
    assert (cfg.prompt_template, cfg.system_prompt, cfg.chat_template_file, cfg.scorer, cfg.max_problems) == (
        "{prompt}!", "be brief", tpl, "math", 5)
    assert (cfg.device, cfg.dtype, cfg.seed, cfg.max_num_seqs, cfg.max_model_len) == ("cpu", "fp32", 3, 9, 333)
    assert (cfg.allow_base_mismatch, cfg.force, cfg.progress, cfg.chat_template) == (True, True, False, None)
    assert cfg.chat_template_kwargs == {"enable_thinking": False}  # the JSON text, parsed
    r = _invoke(args[:9] + ["--no-chat-template"])
    assert r.exit_code == 0, r.output
    assert eval_calls.cfgs[-1].chat_template is False


def test_eval_prints_the_table_or_with_q_the_result_line_and_says_already_done(eval_calls, tmp_path):
    base = ["eval", "--model", tmp_path / "m", "--dataset", tmp_path / "d.jsonl", "--out", tmp_path / "o"]
    r = _invoke(base)
    # the table, then the result line naming --out (a log holding several evals tied no score to its run)
    assert r.output.index("THE-TABLE") < r.output.index("THE-RESULT") and "already done" not in r.output
    r = _invoke([*base, "-q"])
    assert "THE-RESULT" in r.output and "THE-TABLE" not in r.output
    eval_calls.done = True
    r = _invoke(base)
    assert r.exit_code == 0 and "already done:" in r.output and "pass --force to redo" in r.output


@pytest.mark.parametrize("args, message", [
    (["eval", "runs/e1", "--model", "m", "--dataset", "d", "--out", "o"], "unexpected argument runs/e1"),
    (["eval", "--compare"], "--compare needs at least one eval output directory"),
    (["eval", "--model", "m", "--dataset", "d"], "--out is required"),
])
def test_eval_refuses_a_stray_dir_an_empty_compare_and_a_missing_out(eval_calls, args, message):
    r = _invoke(args)
    assert r.exit_code == 2 and message in r.output, r.output
    assert eval_calls.cfgs == []


# ---- qerl merge ------------------------------------------------------------------------------------
@pytest.fixture
def merge_calls(monkeypatch):
    """``qerl merge`` with ``merge`` recorded; ``result`` is what the fake returns."""
    import qerl_cli.merge as mg

    calls = SimpleNamespace(cfgs=[], progress=[], result={"summary": {}, "timings": {}})

    def fake(cfg, progress=True):
        calls.cfgs.append(cfg)
        calls.progress.append(progress)
        return calls.result

    monkeypatch.setattr(mg, "merge", fake)
    return calls


def test_merge_flag_defaults_are_the_configs(merge_calls, tmp_path):
    from qerl_cli.merge import MergeConfig

    m, a, o = tmp_path / "m", tmp_path / "a", tmp_path / "o"
    r = _invoke(["merge", "--model", m, "--adapter", a, "--out", o])
    assert r.exit_code == 0, r.output
    assert merge_calls.cfgs == [MergeConfig(model=m, adapter=a, out=o)] and merge_calls.progress == [True]


def test_merge_flags_reach_the_config(merge_calls, tmp_path):
    r = _invoke(["merge", "--model", tmp_path / "m", "--adapter", tmp_path / "a", "--out", tmp_path / "o",
                 "--dtype", "nvfp4", "--max-shard-size", "2GB", "--device", "cpu",
                 "--requantize-from", tmp_path / "bf",
                 "--allow-base-mismatch", "--force", "-q"])
    assert r.exit_code == 0, r.output
    (cfg,) = merge_calls.cfgs
    assert (cfg.dtype, cfg.max_shard_size, cfg.device, cfg.requantize_from) == ("nvfp4", 2_000_000_000, "cpu",
                                                                                tmp_path / "bf")
    assert (cfg.allow_base_mismatch, cfg.force, merge_calls.progress) == (True, True, [False])


def test_merge_result_line_reports_requantization_and_a_zero_retained_update(merge_calls, tmp_path):
    args = ["merge", "--model", tmp_path / "m", "--adapter", tmp_path / "a", "--out", tmp_path / "o", "-q"]
    merge_calls.result = {"summary": {"merged_modules": 3, "replaced_tensors": 1, "dtype": "nvfp4",
                                      "lineage": "verified",
                                      "requantization": {"rel_err_mean": 0.01, "rel_err_max": 0.02,
                                                         "update_retained": 0.0}},
                          "timings": {"total_s": 1.0}}
    r = _invoke(args)
    assert "merged 3 LoRA modules (+1 trained tensors)" in r.output
    assert "re-quantization rel. error mean 0.0100, max 0.0200; LoRA update retained 0%" in r.output
    merge_calls.result = {"already_done": True, "summary": {}, "timings": {}}
    r = _invoke(args)
    assert r.exit_code == 0 and "already done:" in r.output and "merged" not in r.output
    # the warning's figure (toward zero): the line said 18% where the warning said 17% for 0.1779 (a review)
    merge_calls.result = {"summary": {"merged_modules": 3, "replaced_tensors": 0, "dtype": "nvfp4", "lineage": "verified",
                                      "requantization": {"rel_err_mean": 0.01, "rel_err_max": 0.02,
                                                         "update_retained": 0.1779}},
                          "timings": {"total_s": 1.0}}
    assert "LoRA update retained 17%" in _invoke(args).output


# ---- qerl quantize ---------------------------------------------------------------------------------
@pytest.fixture
def quantize_calls(monkeypatch):
    """``qerl quantize`` with ``quantize`` recorded and the summary table replaced by a marker."""
    import qerl_cli.quantize as qz

    calls = SimpleNamespace(cfgs=[], done=False, summaries=0)

    def fake(cfg, console=None):
        calls.cfgs.append(cfg)
        return SimpleNamespace(already_done=calls.done, out=cfg.out)

    def summary(result, console):
        calls.summaries += 1

    monkeypatch.setattr(qz, "quantize", fake)
    monkeypatch.setattr(qz, "render_summary", summary)
    monkeypatch.setattr(qz, "return_freed_memory_to_os", lambda: None)
    return calls


def test_quantize_flag_defaults_are_the_configs(quantize_calls, tmp_path):
    from qerl_cli.quantize import QuantizeConfig

    r = _invoke(["quantize", tmp_path / "src", "--out", tmp_path / "q"])
    assert r.exit_code == 0, r.output
    assert quantize_calls.cfgs == [QuantizeConfig(src=tmp_path / "src", out=tmp_path / "q")]


def test_quantize_flags_reach_the_config_and_q_means_no_progress(quantize_calls, tmp_path):
    r = _invoke(["quantize", tmp_path / "src", "-o", tmp_path / "q", "--format", "modelopt", "--device", "cpu",
                 "--max-shard-size", "1GB", "--force", "-q"])
    assert r.exit_code == 0, r.output
    (cfg,) = quantize_calls.cfgs
    assert (cfg.out, cfg.format, cfg.device, cfg.max_shard_size, cfg.force, cfg.progress) == (
        tmp_path / "q", "modelopt", "cpu", "1GB", True, False)


def test_quantize_prints_the_summary_only_with_progress_and_says_already_done(quantize_calls, tmp_path):
    base = ["quantize", tmp_path / "src", "--out", tmp_path / "q"]
    for extra, summaries in (([], 1), (["--no-progress"], 1), (["-q"], 1), (["--progress"], 2)):
        r = _invoke([*base, *extra])
        assert r.exit_code == 0 and f"wrote {tmp_path / 'q'}" in r.output
        assert quantize_calls.summaries == summaries, extra
    quantize_calls.done = True
    r = _invoke(base)
    assert "already done:" in r.output and "wrote" not in r.output


# ---- qerl train-step -------------------------------------------------------------------------------
@pytest.fixture
def step_calls(monkeypatch):
    """``qerl train-step`` with ``train_step`` recorded; ``result`` is what the fake returns."""
    import qerl_cli.train_step as ts

    calls = SimpleNamespace(cfgs=[], result={"stage": "train-step"})

    def fake(cfg):
        calls.cfgs.append(cfg)
        return calls.result

    monkeypatch.setattr(ts, "train_step", fake)
    monkeypatch.setattr(ts, "result_line", lambda out, res, already_done=False: f"THE-RESULT done={already_done}")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return calls


def _step_args(tmp_path, *extra):
    return ["train-step", "--model", tmp_path / "m", "--shards", tmp_path / "sh", "--out", tmp_path / "o", *extra]


def test_train_step_flag_defaults_are_the_configs(step_calls, tmp_path):
    from qerl_cli.train_step import TrainStepConfig

    r = _invoke(_step_args(tmp_path))
    assert r.exit_code == 0, r.output
    want = TrainStepConfig(model=tmp_path / "m", shards=[str(tmp_path / "sh")], out=tmp_path / "o")
    assert step_calls.cfgs == [want]


def test_train_step_flags_reach_the_config(step_calls, tmp_path):
    r = _invoke(_step_args(
        tmp_path, "--shards", "more/*.jsonl", "--adapter", tmp_path / "a", "--loss", "bnpo",
        "--scale-rewards", "none",
        "--clip-eps", "0.1", "--clip-eps-high", "0.3", "--beta", "0.04", "--tis-cap", "3", "--mask-truncated",
        "--max-completion-length", "99", "--epochs", "2", "--lr", "3e-5", "--warmup-steps", "4",
        "--total-steps", "40",
        "--min-lr-ratio", "0.1", "--weight-decay", "0.01", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--max-grad-norm", "1.5", "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05",
        "--lora-targets", "q_proj, v_proj", "--lora-targets", "o_proj", "--train-norms", "--micro-batch-tokens",
        "512", "--logits-chunk-tokens", "64", "--no-checkpointing", "--offload-activations", "--embeddings-on-cpu",
        "--device", "cpu", "--dtype", "fp32", "--baseline", "bf16", "--seed", "7", "--skip-bad-lines",
        "--metrics-file", tmp_path / "mf.jsonl", "--force", "-q"))
    assert r.exit_code == 0, r.output
    (cfg,) = step_calls.cfgs
    got = dataclasses.asdict(cfg)
    want = dict(shards=[str(tmp_path / "sh"), "more/*.jsonl"], adapter=tmp_path / "a", loss="bnpo",
                scale_rewards="none", clip_eps=0.1, clip_eps_high=0.3, beta=0.04, tis_cap=3.0, mask_truncated=True,
                max_completion_length=99, epochs=2, lr=3e-5, warmup_steps=4, total_steps=40, min_lr_ratio=0.1,
                weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.95, max_grad_norm=1.5, lora_rank=8,
                lora_alpha=32.0, lora_dropout=0.05, lora_targets=("q_proj", "v_proj", "o_proj"), train_norms=True,
                micro_batch_tokens=512, logits_chunk_tokens=64, gradient_checkpointing=False,
                offload_activations=True, embeddings_on_cpu=True, device="cpu", dtype="fp32", baseline="bf16",
                seed=7, skip_bad_lines=True, metrics_file=tmp_path / "mf.jsonl", force=True, progress=False)
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("spec", [",", " , "])
def test_train_step_lora_targets_naming_nothing_are_refused(step_calls, tmp_path, spec):
    r = _invoke(_step_args(tmp_path, "--lora-targets", spec))
    assert r.exit_code == 2 and f"--lora-targets {spec!r} names no Linear" in r.output, r.output  # the flag, as typed
    assert step_calls.cfgs == []


def test_train_step_q_prints_the_result_line_once_and_only_with_q(step_calls, tmp_path):
    r = _invoke(_step_args(tmp_path))  # train_step prints its own result without -q
    assert r.exit_code == 0 and "THE-RESULT" not in r.output
    r = _invoke(_step_args(tmp_path, "-q"))
    assert r.output.count("THE-RESULT done=False") == 1
    step_calls.result = {"already_done": True}
    r = _invoke(_step_args(tmp_path, "-q"))
    assert r.output.count("THE-RESULT done=True") == 1
    step_calls.result = {}  # no result (e.g. a rank that wrote nothing): nothing to print
    r = _invoke(_step_args(tmp_path, "-q"))
    assert "THE-RESULT" not in r.output



# ---- train.metrics ---------------------------------------------------------------------------------
def test_accumulator_min_of_positives_and_max_of_negatives_and_a_mean_of_nothing():
    from qerl_cli.train.metrics import Accumulator

    acc = Accumulator()
    acc.min(ratio=1.5)
    acc.min(ratio=2.5)
    acc.max(logp=-3.0)
    acc.max(logp=-2.0)
    assert (acc.mins["ratio"], acc.maxs["logp"]) == (1.5, -2.0)  # not 0: the extremes start at +-inf
    acc.add(kl=0.0)
    assert acc.mean("kl", "tokens") is None  # no tokens: no mean (null in metrics.jsonl), not 0


# ---- train.batching --------------------------------------------------------------------------------
def test_collate_refuses_a_sequence_with_an_empty_prompt():
    from qerl_cli.errors import BadInputError
    from qerl_cli.train.batching import collate

    # its first completion token would be "predicted" by column -1, the last padding column
    with pytest.raises(BadInputError, match="sequence 1 has an empty prompt"):
        collate(0, [0, 1], [[3, 4], []], [[5], [6, 7]])


# ---- train.distributed -----------------------------------------------------------------------------
def test_each_rank_owns_every_world_size_th_micro_batch_from_its_rank():
    from qerl_cli.train.distributed import Dist

    assert [i for i in range(8) if Dist(rank=1, world_size=3).owns(i)] == [1, 4, 7]
    assert all(Dist().owns(i) for i in range(4))


def test_rank_0s_failure_reaches_the_other_ranks_with_its_exit_code(monkeypatch):
    from qerl_cli.errors import BadInputError, QerlError
    from qerl_cli.train.distributed import Dist

    shared = []  # what each rank contributes to the all-reduce; the "reduced" value is their max

    def all_reduce_(self, t, op="sum"):
        shared.append(int(t.item()))
        return t.fill_(max(shared))

    monkeypatch.setattr(Dist, "all_reduce_", all_reduce_)
    with pytest.raises(BadInputError):  # rank 0 re-raises its own error, sharing its exit code
        Dist(rank=0, world_size=2).main_outcome(BadInputError("bad shard"), "cpu")
    assert shared == [2]
    with pytest.raises(QerlError, match=r"rank 0 could not finish the step's output \(exit 2\)") as e:
        Dist(rank=1, world_size=2).main_outcome(None, "cpu")
    assert e.value.exit_code == 2
    shared.clear()
    Dist(rank=1, world_size=2).main_outcome(None, "cpu")  # everyone succeeded: nothing raised
    with pytest.raises(ValueError, match="alone"):  # a single process raises its own failure
        Dist().main_outcome(ValueError("alone"), "cpu")


def test_a_single_process_is_main_whatever_rank_says(monkeypatch):
    from qerl_cli.train.distributed import main_by_environment

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "3")  # left over from a launcher: alone, it still writes and prints
    assert main_by_environment()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not main_by_environment()


def test_joining_a_started_group_takes_local_rank_from_rank_and_leaves_the_group_up(monkeypatch):
    from qerl_cli.train import distributed

    destroyed = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: destroyed.append(1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    d = distributed.setup("cpu")
    assert (d.rank, d.world_size, d.local_rank, d.initialized_here) == (1, 2, 1, False)
    d.close()
    assert destroyed == []  # the caller's process group: not this step's to end
    distributed.Dist(1, 2, 1, initialized_here=True).close()
    assert destroyed == [1]


# ---- train.losses ----------------------------------------------------------------------------------
def test_dr_grpo_accepts_a_budget_equal_to_the_longest_completion():
    from qerl_cli.train.losses import sequence_weights

    w = sequence_weights("dr_grpo", [3, 5], max_completion_length=5)
    assert w.tolist() == [1 / 10, 1 / 10]


def test_on_policy_ratios_of_exactly_one_are_not_counted_as_clipped():
    import torch

    from qerl_cli.train.losses import LossConfig, policy_loss

    # --clip-eps 0 --clip-eps-high 0: the first epoch's ratios are exactly 1, inside [1 - 0, 1 + 0]
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.7])
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    cfg = LossConfig(clip_eps=0.0, clip_eps_high=0.0)
    _, _, stats = policy_loss(logp, logp.clone(), adv, torch.full((4,), 0.25), cfg)
    assert (stats.tokens, stats.clip_low, stats.clip_high) == (4, 0, 0)


def test_a_masked_token_is_not_counted_as_clipped():
    import torch

    from qerl_cli.train.losses import LossConfig, policy_loss

    old = torch.zeros(4)
    logp = torch.tensor([1.0, 1.0, -1.0, -1.0])  # ratios e and 1/e: far outside [0.8, 1.28]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    weight = torch.tensor([0.5, 0.0, 0.5, 0.0])  # tokens 1 and 3 are masked (--mask-truncated)
    _, _, stats = policy_loss(logp, old, adv, weight, LossConfig())
    assert (stats.tokens, stats.clip_low, stats.clip_high) == (2, 1, 1)


@pytest.mark.parametrize("kw, flag", [(dict(beta=float("inf")), "--beta"),
                                      (dict(clip_eps_high=float("nan")), "--clip-eps-high")])
def test_loss_config_refuses_an_infinite_beta_and_a_nan_clip_high(kw, flag):
    from qerl_cli.errors import BadInputError
    from qerl_cli.train.losses import LossConfig

    with pytest.raises(BadInputError, match=flag):
        LossConfig(**kw).validate()


# ---- train.logprobs --------------------------------------------------------------------------------
def test_token_logprobs_with_a_chunk_of_zero_works_in_chunks_of_one():
    import torch

    from qerl_cli.train.logprobs import token_logprobs

    torch.manual_seed(0)
    w = torch.randn(5, 3)
    model = SimpleNamespace(compute_logits=lambda h: h @ w.T)  # not a dense QLinear head: the autograd path
    h, t, it = torch.randn(4, 3), torch.tensor([0, 4, 2, 1]), torch.ones(4)
    lp0, ent0 = token_logprobs(model, h, t, it, chunk=0)
    want = torch.log_softmax(h @ w.T, -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(lp0, want)
    assert ent0.shape == (4,)


def test_a_trained_lm_head_bias_gets_its_gradient():
    import torch

    from qerl_cli.layers.linear import QLinear
    from qerl_cli.models import ModelConfig, build_random_model
    from qerl_cli.train.logprobs import token_logprobs
    from tests.helpers import tiny_config

    cfg = tiny_config(hidden=16, layers=1, heads=2, kv_heads=1, vocab=32).to_dict()
    model = build_random_model(ModelConfig.from_hf(cfg), device="cpu", dtype=torch.float32, quantized=False)
    head = QLinear(16, 32, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
    head.bias.requires_grad_(True)  # e.g. a library user training the head's bias: no frozen-head shortcut
    model.lm_head = head
    torch.manual_seed(0)
    h, t = torch.randn(5, 16, requires_grad=True), torch.tensor([1, 2, 3, 4, 5])
    lp, _ = token_logprobs(model, h, t, torch.ones(5))
    lp.sum().backward()
    p = torch.softmax(h.detach() @ head.weight.detach().T, -1)
    want = torch.nn.functional.one_hot(t, 32).float().sum(0) - p.sum(0)  # d sum(log p_t) / d bias
    torch.testing.assert_close(head.bias.grad, want)


# ---- train.offload ---------------------------------------------------------------------------------
def test_offloader_takes_float_tensors_of_at_least_min_bytes_only():
    import torch

    from qerl_cli.train.offload import ActivationOffloader, _Saved

    off = ActivationOffloader("cpu", min_bytes=64)
    exact, small = torch.ones(16), torch.ones(15)  # 64 and 60 bytes of fp32
    positions = torch.arange(64)  # 512 bytes, but not float: the positions every checkpoint saves
    assert isinstance(off._pack(exact), _Saved)
    assert off._pack(small) is small and off._pack(positions) is positions
    assert (off.stats["packed"], off.stats["packed_bytes"]) == (1, 64)


def _recording_offloader(monkeypatch):
    """A CPU offloader whose fetches are recorded, its first forward begun: (offloader, fetched handles)."""
    from qerl_cli.train.offload import ActivationOffloader

    off = ActivationOffloader("cpu")
    fetched = []
    real = off._fetch
    monkeypatch.setattr(off, "_fetch", lambda h: (fetched.append(h), real(h)))
    off.begin()
    return off, fetched


def test_a_tensor_already_prefetched_is_not_fetched_again(monkeypatch):
    import torch

    off, fetched = _recording_offloader(monkeypatch)
    a, b = off._pack(torch.ones(4)), off._pack(torch.zeros(4))
    assert torch.equal(off._unpack(b), torch.zeros(4))  # b fetched, a prefetched
    assert torch.equal(off._unpack(b), torch.zeros(4))  # b again (a retained graph): a is already here
    assert fetched == [b, a, b]
    assert torch.equal(off._unpack(a), torch.ones(4)) and off.stats["prefetched"] == 1


def test_a_new_forward_does_not_prefetch_the_last_ones_tensors(monkeypatch):
    import torch

    off, fetched = _recording_offloader(monkeypatch)
    first = off._pack(torch.ones(4))  # micro-batch 1's forward
    off.begin()
    second = off._pack(torch.zeros(4))  # micro-batch 2's: the first tensor of its forward
    off._unpack(second)
    assert fetched == [second] and first.fetched is None


def test_offloader_describes_its_threshold_and_prefetch():
    from qerl_cli.train.offload import ActivationOffloader

    assert ActivationOffloader("cpu", min_bytes=1024).describe() == (
        "checkpointed layer inputs of >= 1024 bytes go to CPU copies, the previous layer's prefetched in backward")
    assert ActivationOffloader("cpu", prefetch=False).describe() == "checkpointed layer inputs go to CPU copies"


# ---- train.optim -----------------------------------------------------------------------------------
def _saved_state(tmp_path, **replace):
    """An optimizer file for one LoRA matrix [2, 3] after one step, with entries replaced (None: dropped)."""
    import torch
    from safetensors.torch import load_file, save_file

    from qerl_cli.train.optim import make_optimizer, save_optimizer

    params = [("a.lora_A", torch.nn.Parameter(torch.ones(2, 3)))]
    opt = make_optimizer(params, lr=1e-2)
    params[0][1].grad = torch.ones(2, 3)
    opt.step()
    save_optimizer(opt, tmp_path / "o.safetensors")
    tensors = load_file(tmp_path / "o.safetensors")
    for key, value in replace.items():
        tensors.pop(f"a.lora_A.{key}")
        if value is not None:
            tensors[f"a.lora_A.{key}"] = value
    save_file(tensors, tmp_path / "o.safetensors")
    return make_optimizer(params, lr=1e-2), tmp_path / "o.safetensors"


def test_optimizer_state_missing_one_entry_is_refused_naming_it(tmp_path):
    from qerl_cli.errors import BadInputError
    from qerl_cli.train.optim import load_optimizer

    with pytest.raises(BadInputError, match="incomplete optimizer state for 'a.lora_A'"):
        load_optimizer(*_saved_state(tmp_path, exp_avg_sq=None))


def test_a_second_moment_of_another_shape_is_refused(tmp_path):
    import torch

    from qerl_cli.errors import BadInputError
    from qerl_cli.train.optim import load_optimizer

    with pytest.raises(BadInputError, match=r"parameter has \(2, 3\)"):
        load_optimizer(*_saved_state(tmp_path, exp_avg_sq=torch.zeros(3, 2)))


def test_a_second_moment_of_another_shape_is_named_in_the_error(tmp_path):
    import torch

    from qerl_cli.errors import BadInputError
    from qerl_cli.train.optim import load_optimizer

    with pytest.raises(BadInputError, match=r"a\.lora_A\.exp_avg_sq has shape \(3, 2\), parameter has \(2, 3\)"):
        load_optimizer(*_saved_state(tmp_path, exp_avg_sq=torch.zeros(3, 2)))


@pytest.mark.parametrize("max_norm", [0.0, None])
def test_max_grad_norm_zero_or_none_leaves_the_gradients_alone(max_norm):
    import torch

    from qerl_cli.train.optim import grad_norm_and_clip

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert grad_norm_and_clip([p], max_norm) == pytest.approx(5.0)
    assert p.grad.tolist() == [3.0, 4.0]


# ---- tasks.arith -----------------------------------------------------------------------------------
def test_task_answer_rule_reads_a_negative_answer():
    from qerl_cli.tasks import extract_answer, is_correct

    assert extract_answer(" 3-5=-2. #### -2") == "-2"
    assert is_correct("#### -2", -2) and not is_correct("#### -2", 2)



def test_a_confused_step_may_bring_the_total_to_zero_but_not_below():
    import random

    from qerl_cli.tasks.arith import Problem, worked_solution

    always = {"buys {n} more": 1.0}
    to_zero = Problem("Mia", "pens", 3, (("buys {n} more", 3),))
    assert worked_solution(to_zero, random.Random(0), always) == " 3-3=0. #### 0"
    below = Problem("Mia", "pens", 3, (("buys {n} more", 4),))
    assert worked_solution(below, random.Random(0), always) == " 3+4=7. #### 7"


def test_generated_problems_are_distinct_and_skip_excluded_prompts():
    from qerl_cli.tasks.arith import TaskSpec, generate

    small = TaskSpec(min_steps=1, max_steps=1, min_start=5, max_start=5, max_operand=1)  # 800 possible prompts
    probs = generate(0, 200, small)
    assert len({p.prompt for p in probs}) == 200
    again = generate(0, 10, small, exclude={probs[0].prompt, probs[3].prompt})
    assert probs[0].prompt not in {p.prompt for p in again} and probs[3].prompt not in {p.prompt for p in again}

def test_task_prompt_with_a_step_by_someone_else_is_not_a_task_prompt():
    from qerl_cli.tasks import parse_prompt

    ok = "Q: Mia has 5 pens. Mia buys 3 more. How many pens does Mia have?\nA:"
    assert parse_prompt(ok).answer == 8
    with pytest.raises(ValueError, match="bad step 'Tom buys 3 more'"):
        parse_prompt(ok.replace("Mia buys", "Tom buys"))



def test_a_prompt_asking_about_another_item_is_not_a_task_prompt():
    from qerl_cli.tasks import parse_prompt

    with pytest.raises(ValueError, match="question"):
        parse_prompt("Q: Mia has 5 pens. Mia buys 3 more. How many cups does Mia have?\nA:")

# ---- checkpoint.source -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, 3, ["model.safetensors"]])
def test_an_index_mapping_a_tensor_to_something_not_a_file_name_is_refused_naming_it(tmp_path, value):
    import json

    import torch
    from safetensors.torch import save_file

    from qerl_cli.checkpoint.source import open_source
    from qerl_cli.errors import BadInputError

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path / "model.safetensors")
    weight_map = {"a": "model.safetensors", "b": value}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(BadInputError, match=r"model\.safetensors\.index\.json: .*'b'"):
        open_source(tmp_path)


def _model_dir(root, tensors: dict | None = None, name: str = "model.safetensors"):
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text("{}")
    save_file({"a": torch.zeros(2)} if tensors is None else tensors, root / name)
    return root


def test_an_empty_weight_map_and_a_shard_without_tensors_are_refused_as_such(tmp_path):
    from qerl_cli.checkpoint.source import open_source
    from qerl_cli.errors import BadInputError

    d = _model_dir(tmp_path / "index")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(BadInputError, match="index.json: no 'weight_map' object"):
        open_source(d)
    with pytest.raises(BadInputError, match="has safetensors files but no tensors in them"):
        open_source(_model_dir(tmp_path / "empty", {}))


def test_a_model_shipped_only_as_consolidated_safetensors_is_read(tmp_path):
    from qerl_cli.checkpoint.source import open_source

    src = open_source(_model_dir(tmp_path, name="consolidated.safetensors"))
    assert list(src.tensors) == ["a"] and [p.name for p in src.shard_files] == ["consolidated.safetensors"]


def test_tensors_are_listed_in_byte_order_whatever_the_header_order(tmp_path):
    import json
    import struct

    from qerl_cli.checkpoint.source import open_source

    d = _model_dir(tmp_path)
    header = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    src = open_source(d)
    assert list(src.tensors) == ["b", "a"]  # reads go through the file front to back

# ---- checkpoint.formats ----------------------------------------------------------------------------
def test_compressed_tensors_block_is_exactly_nvfp4a16_and_the_callers_config_is_left_alone():
    from qerl_cli.checkpoint.formats import NVFP4Format

    config = {"model_type": "qwen2", "tie_word_embeddings": False}
    out = NVFP4Format("compressed-tensors").update_config(config, ["lm_head"])
    assert config == {"model_type": "qwen2", "tie_word_embeddings": False}  # the source's config, unchanged
    q = out["quantization_config"]
    assert (q["quant_method"], q["format"], q["ignore"]) == ("compressed-tensors", "nvfp4-pack-quantized", ["lm_head"])
    assert q["config_groups"]["group_0"]["weights"] == {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                        "group_size": 16, "symmetric": True, "dynamic": False}
    assert NVFP4Format("modelopt").update_config(config, ["lm_head"]) == config


# ---- engine.model_runner ---------------------------------------------------------------------------
def test_decode_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    from qerl_cli.engine.model_runner import graph_batch_sizes

    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]  # the largest batch has a graph of its own
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_exactly_the_most_groups_admitted_at_once_still_replay_graphs():
    from qerl_cli.engine.model_runner import PREFILL_GRAPH_MAX_GROUPS, ModelRunner
    from qerl_cli.engine.scheduler import Group

    runner = SimpleNamespace(prefill_graphs={64: None, 128: None})
    groups = [Group(0, list(range(10)), 8, 20) for _ in range(PREFILL_GRAPH_MAX_GROUPS)]
    assert ModelRunner._prefill_buckets(runner, groups) == [64] * PREFILL_GRAPH_MAX_GROUPS



def test_decode_seeds_continue_the_prefill_seeds_one_position_per_token():
    import torch

    from qerl_cli.engine.model_runner import ModelRunner
    from qerl_cli.engine.sequence import Sequence

    runner = SimpleNamespace(use_graphs=False, graph_sizes=[1, 2, 4], device=torch.device("cpu"), max_num_seqs=4,
                             state=torch.zeros(4, 4, dtype=torch.long))
    # prefill drew each sequence's first token with seed rng + len(prompt) (llm_engine); these have one token since
    seqs = [Sequence(0, 0, [5, 6, 7, 9], 3, 10, slot=0, rng=100),
            Sequence(1, 0, [1, 2, 3, 4, 5, 8], 5, 10, slot=2, rng=1000)]
    assert ModelRunner.load_batch(runner, seqs) == 2
    assert ModelRunner.seeds(runner).tolist() == [104, 1006]  # rng + len(seq): one past the prefill's seed
    ModelRunner.advance(runner, torch.tensor([11, 12]))
    assert ModelRunner.seeds(runner).tolist() == [105, 1007] and runner.state[0, :2].tolist() == [11, 12]

class _Block:
    """A stand-in for ``compile_ahead.compile_only``: records what ran inside it; ``stats`` is what it yields."""

    def __init__(self, log, stats):
        self.log, self.stats = log, stats

    def __enter__(self):
        self.log.append("block")
        return self.stats

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("sent, compiled, second_block", [
    (2, None, False),  # the largest step sent kernels to the workers: the rest went along in that block
    (0, 0, False),     # nothing sent and nothing compiled: every kernel is cached, skip the rest
    (0, 3, True),      # no workers, compiles on threads: the rest in a second block
    (0, None, True),   # this Triton cannot tell what compiled: compile the rest to be safe
])
def test_engine_compiles_the_other_steps_ahead_unless_the_largest_found_everything_cached(
        monkeypatch, sent, compiled, second_block):
    import torch

    from qerl_cli.engine import model_runner

    log = []
    stats = iter([SimpleNamespace(sent=sent, compiled=compiled), SimpleNamespace(sent=0, compiled=0)])
    monkeypatch.setattr(model_runner, "compile_ahead", SimpleNamespace(
        available=lambda: True, compile_only=lambda: _Block(log, next(stats))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.delenv("QERL_COMPILE_AHEAD", raising=False)
    runner = SimpleNamespace(graph_sizes=[1, 2, 4], state=torch.zeros(4, 4, dtype=torch.long),
                             _decode_step=lambda ids, *a: log.append(f"decode {len(ids)}"),
                             _prefill_step=lambda inputs: log.append(f"prefill {inputs}"),
                             _scratch_prefill_inputs=lambda length: length)
    model_runner.ModelRunner._compile_ahead(runner, [64, 128])
    rest = ["decode 2", "decode 1", "prefill 64", "prefill 128"]
    if sent:
        assert log == ["block", "decode 4", *rest]
    else:
        assert log == ["block", "decode 4", *(["block", *rest] if second_block else [])]
    log.clear()
    monkeypatch.setenv("QERL_COMPILE_AHEAD", "0")
    model_runner.ModelRunner._compile_ahead(runner, [64])
    assert log == []


def test_only_a_prompts_partial_last_block_is_copied_to_its_siblings():
    import torch

    from qerl_cli.engine.model_runner import ModelRunner

    def group(prompt_len, tables):  # the two fields of a scheduler Group that the fork reads
        return SimpleNamespace(prompt_ids=[0] * prompt_len, seqs=[SimpleNamespace(block_table=t) for t in tables])
    kv = torch.arange(2 * 1 * 8 * 4, dtype=torch.float32).reshape(2, 1, 8, 4, 1)  # [k/v, layers, blocks, bs, ...]
    runner = SimpleNamespace(block_size=4, kv=kv.clone(), device="cpu")
    # 8 tokens fill blocks 1-2 (shared); block 3 / 4 are each child's own, for its first generated token
    ModelRunner._fork_partial_blocks(runner, [group(8, [[1, 2, 3], [1, 2, 4]])])
    assert torch.equal(runner.kv, kv)
    # 6 tokens: block 2 holds 2 of them, copied from child 0's block 2 into child 1's block 5
    ModelRunner._fork_partial_blocks(runner, [group(6, [[1, 2], [1, 5]])])
    want = kv.clone()
    want[:, :, 5] = kv[:, :, 2]
    assert torch.equal(runner.kv, want)


# ---- qerl_kernels.compile_workers ------------------------------------------------------------------
@pytest.fixture
def workers():
    pytest.importorskip("triton")
    return pytest.importorskip("qerl_kernels.compile_workers")


def test_a_function_posing_under_another_kernels_name_is_not_shipped(workers):
    pytest.importorskip("qerl_kernels.dequant")
    impostor = SimpleNamespace(fn=SimpleNamespace(__module__="qerl_kernels.dequant",
                                                  __qualname__="_nvfp4_dequant_kernel"))
    assert workers.shippable(impostor) is None  # the worker would import and compile the real one instead


def test_the_pool_starts_at_most_size_feeder_threads(workers, monkeypatch):
    pool = workers.WorkerPool(2)
    monkeypatch.setattr(pool, "_feed", lambda: None)  # feeders that take nothing: only their count matters
    for _ in range(4):
        pool.submit(("m", "f", {}, {}, {}, {}, None))
    assert len(pool.threads) == 2
    for t in pool.threads:
        t.join()



def test_a_frame_cut_short_reads_as_a_worker_that_exited(workers):
    import io

    assert workers._read(io.BytesIO(b"")) is None
    assert workers._read(io.BytesIO(b"\x05\x00\x00")) is None  # died while writing its answer's length


def test_a_worker_that_answers_garbage_is_killed_and_its_job_fails(workers, monkeypatch):
    import time

    def junk(requests, answers):  # one unreadable frame, then it would live on for a minute
        answers.write(b"\x05" + bytes(7) + b"junk!")
        answers.flush()
        time.sleep(60)

    monkeypatch.setattr(workers, "_serve", junk)  # the fork inherits it
    pool = workers.WorkerPool(1)
    try:
        with pytest.raises(Exception):  # noqa: B017 - pickle's error class for junk varies
            pool.submit(("m", "f", {}, {}, {}, {}, None)).result(timeout=30)
        (worker,) = pool.workers
        deadline = time.monotonic() + 120  # generous: a loaded machine is slower, not wrong
        while not worker.reaped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.reaped, "the worker that failed its job is still running"
    finally:
        pool.close(timeout=5)


def test_jobs_queued_behind_a_hung_worker_fail_at_close_without_new_workers(workers, monkeypatch, tmp_path):
    import time

    started = tmp_path / "started"
    monkeypatch.setattr(workers, "_compile", lambda *job: started.touch() or time.sleep(120))
    pool = workers.WorkerPool(1)
    first, second = (pool.submit(("m", f, {}, {}, {}, {}, None)) for f in ("f", "g"))
    deadline = time.monotonic() + 120  # the first job reaches the worker (a `sleep 0.3` was too short when loaded)
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pool.close(timeout=0.5)
    assert first.exception(timeout=0) is not None
    with pytest.raises(TimeoutError, match="compile workers timed out"):
        second.result(timeout=0)
    assert len(pool.workers) == 1  # the queued job started no second worker


def test_close_stops_every_feeder_thread(workers, monkeypatch):
    import threading

    monkeypatch.setattr(workers, "_serve", lambda requests, answers: None)  # workers that exit at once
    pool = workers.WorkerPool(2)
    jobs = [pool.submit(("m", f, {}, {}, {}, {}, None)) for f in ("f", "g")]
    assert len(pool.threads) == 2
    for job in jobs:
        assert job.exception(timeout=30) is not None
    closer = threading.Thread(target=pool.close, kwargs={"timeout": 30}, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "close() is still waiting for a feeder thread"
    assert not any(t.is_alive() for t in pool.threads)


# ---- qerl_kernels.compile_ahead -------------------------------------------------------------------
def test_worker_compiles_are_counted_as_real_compiles_only():
    from concurrent.futures import Future

    compile_ahead = pytest.importorskip("qerl_kernels.compile_ahead")

    def done(value=None, error=None):
        f = Future()
        f.set_exception(error) if error else f.set_result(value)
        return f

    futures = [done(True), done(False), done(error=RuntimeError("ptxas")), done(True)]
    assert compile_ahead._count_worker_compiles(futures, None) == 2  # a cache hit and a failure are not compiles
    assert compile_ahead._count_worker_compiles(futures, 3) == 5  # plus those compiled on threads here


def test_compile_processes_default_to_the_cpus_at_most_16_and_take_the_environment(monkeypatch):
    compile_ahead = pytest.importorskip("qerl_kernels.compile_ahead")

    monkeypatch.delenv("QERL_COMPILE_PROCESSES", raising=False)
    monkeypatch.setenv("QERL_COMPILE_THREADS", "24")  # 24 usable CPUs: 16 workers, each its own torch + Triton
    assert compile_ahead.default_processes() == 16
    monkeypatch.setenv("QERL_COMPILE_THREADS", "6")
    assert compile_ahead.default_processes() == 6
    monkeypatch.setenv("QERL_COMPILE_PROCESSES", " 20 ")  # an explicit count is taken as it is
    assert compile_ahead.default_processes() == 20
    monkeypatch.setenv("QERL_COMPILE_PROCESSES", "-1")
    with pytest.raises(ValueError, match="QERL_COMPILE_PROCESSES must be a whole number >= 0, got '-1'"):
        compile_ahead.default_processes()


@pytest.mark.parametrize("args, hint", [
    (["train-step", "--model", "m", "--shards", "a", "b", "--out", "o"], "; --shards takes one value, repeated"),
    (["rollout", "--model", "m", "--prompts", "p", "--out", "o", "--reward", "gsm8k", "format"], "; --reward takes one"),
    (["rollout", "--model", "m", "--prompts", "p", "--stop", "X", "--out", "o", "extra"], None),
    # eval takes positional dirs (for --compare): `--stop a b` said "pass --compare DIR..." (session 52 docs review)
    (["eval", "--model", "m", "--dataset", "d", "--out", "o", "--stop", "X", "Y"], "; --stop takes one value"),
    # the --flag=value spelling (docs name --shards=~/r): Click's bare message, and eval's "pass --compare" (a review)
    (["train-step", "--model", "m", "--shards=a", "b", "--out", "o"], "; --shards takes one value, repeated"),
    (["eval", "--model", "m", "--dataset", "d", "--out", "o", "--stop=X", "Y"], "; --stop takes one value"),
])
def test_several_values_after_a_repeated_flag_name_the_repetition(args, hint):
    """`--shards a b`, as stages.md spells it, was "Got unexpected extra argument(s) (b)" with no word of why (a
    review). A flag that takes several values takes one each time it is given: the error now says so; a stray
    word elsewhere keeps Click's message."""
    r = _invoke(args)
    assert r.exit_code == 2 and "unexpected" in r.output and "argument" in r.output, r.output
    assert (hint.removeprefix("; ") in r.output) if hint else "takes one value" not in r.output, r.output
    assert "--compare" not in r.output, r.output
