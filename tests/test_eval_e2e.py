"""`qerl eval` end to end on CPU with the native engine: a tiny model, with and without an adapter.

The adapter tests are the regression tests for the reference code's eval, which silently dropped
the LoRA: the same prompts must give different completions once the adapter is applied, and the
merged checkpoint (base + adapter folded by `qerl merge`) must give the adapter's completions.
"""

import json

import pytest

from qerl_cli.evaluate import EvalConfig, evaluate
from qerl_cli.hashing import model_hash
from tests.helpers import make_tiny_hf_model
from tests.test_merge import make_peft_adapter

ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many altogether?", "answer": "#### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "#### 10"},
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    base = make_tiny_hf_model(tmp, arch="qwen2", hidden=64, layers=2, init_std=0.05)
    adapter = make_peft_adapter(base, tmp / "adapter", scale=0.2)
    data = tmp / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp, base, adapter, data


def _eval(model, data, out, **kw):
    kw.setdefault("max_new_tokens", 24)
    cfg = EvalConfig(model=model, dataset=data, out=out, device="cpu", progress=False, **kw)
    return evaluate(cfg)


def _completions(out):
    return [json.loads(x)["completion"] for x in (out / "samples.jsonl").read_text().splitlines()]


def test_eval_end_to_end_and_adapter_changes_outputs(setup):
    tmp, base, adapter, data = setup
    plain = _eval(base, data, tmp / "e-base")
    m = plain["metrics"]
    assert m["counts"]["problems"] == 3 and m["counts"]["samples"] == 3
    assert m["scored_with"] == {"gsm8k": 2, "math": 1}
    assert m["lora_modules"] == 0 and m["engine"] == "native" and m["dtype"] == "fp32"
    assert 0 <= m["score"] <= 1 and m["lengths"]["max"] <= 24
    samples = [json.loads(x) for x in (tmp / "e-base" / "samples.jsonl").read_text().splitlines()]
    assert m["counts"]["truncated"] == sum(s["finish_reason"] == "length" for s in samples)
    assert all(s["num_tokens"] == 24 for s in samples if s["finish_reason"] == "length")
    assert [s["reference"] for s in samples] == ["72", "10", "\\frac{3}{4}"]

    tuned = _eval(base, data, tmp / "e-adapter", adapter=adapter)
    assert tuned["metrics"]["lora_modules"] == 14 and tuned["metrics"]["lineage"] == "verified"
    assert tuned["metrics"]["adapter_hash"] and tuned["metrics"]["model_hash"] == model_hash(base)
    a, b = _completions(tmp / "e-base"), _completions(tmp / "e-adapter")
    assert a != b, "the adapter did not change any completion: it was not applied"


@pytest.mark.parametrize("with_adapter", [True, False])
def test_a_resume_with_every_problem_kept_loads_no_model(setup, monkeypatch, with_adapter):
    # A resume whose every problem was saved (a stop after the last one) loaded the model (minutes for a 32B model)
    # to generate nothing. It loads none now, and metrics.json still records the LoRA modules the model would carry.
    import shutil

    import qerl_cli.evaluate as ev

    tmp, base, adapter, data = setup
    name = f"kept-{with_adapter}"
    kw = {"adapter": adapter} if with_adapter else {}
    full = _eval(base, data, tmp / f"{name}-ref", **kw)
    partial = tmp / f".{name}.partial-{full['manifest']['fingerprint'][:16]}"  # the fingerprint does not count --out
    partial.mkdir()
    shutil.copy(tmp / f"{name}-ref" / "samples.jsonl", partial)
    monkeypatch.setattr(ev, "native_generator", lambda *a: pytest.fail("the model was loaded"))
    res = _eval(base, data, tmp / name, **kw)
    assert res["manifest"]["resumed"]["problems"] == 3 and not partial.exists()
    assert res["metrics"]["lora_modules"] == (14 if with_adapter else 0)
    assert {**res["metrics"], "time": None} == {**full["metrics"], "time": None}


def test_merged_checkpoint_generates_the_adapters_completions(tmp_path):
    """Bundled pretrained model (confident argmaxes, unlike a random one) + a random adapter: the
    adapter changes most completions, and `qerl merge`'s output reproduces every one of them."""
    from qerl_cli.assets import tiny_model_dir, tiny_task_file
    from qerl_cli.merge import MergeConfig, merge

    ad = make_peft_adapter(tiny_model_dir(), tmp_path / "ad", scale=0.1)
    merge(MergeConfig(tiny_model_dir(), ad, tmp_path / "merged"), progress=False)
    kw = dict(max_problems=12, max_new_tokens=40)
    _eval(tiny_model_dir(), tiny_task_file("test"), tmp_path / "e-base", **kw)
    _eval(tiny_model_dir(), tiny_task_file("test"), tmp_path / "e-ad", adapter=ad, **kw)
    _eval(tmp_path / "merged", tiny_task_file("test"), tmp_path / "e-merged", **kw)
    base, tuned, merged = (_completions(tmp_path / n) for n in ("e-base", "e-ad", "e-merged"))
    assert sum(x != y for x, y in zip(base, tuned)) >= 6, (base, tuned)
    assert merged == tuned


def test_pass_at_k_sampling_is_reproducible(setup):
    tmp, base, _, data = setup
    r1 = _eval(base, data, tmp / "k1", k=4, temperature=1.0, seed=3)
    r2 = _eval(base, data, tmp / "k2", k=4, temperature=1.0, seed=3)
    assert r1["metrics"]["counts"]["samples"] == 12
    assert set(r1["metrics"]["scores"]) == {"pass@1", "pass@2", "pass@4"}
    assert _completions(tmp / "k1") == _completions(tmp / "k2")
    assert r2["metrics"]["scores"] == r1["metrics"]["scores"]
    texts = _completions(tmp / "k1")
    assert len(set(texts[:4])) > 1  # the 4 samples of a problem differ


def test_adapter_for_another_base_is_refused(setup):
    from qerl_cli.errors import LineageError

    tmp, _, adapter, data = setup
    other = make_tiny_hf_model(tmp, arch="qwen2", hidden=64, layers=2, seed=5, name="other")
    with pytest.raises(LineageError):
        _eval(other, data, tmp / "bad", adapter=adapter)
    assert not (tmp / "bad").exists()


def test_cli_eval_prints_scores_and_rerun_is_done(setup):
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    tmp, base, adapter, data = setup
    args = ["eval", "--model", str(base), "--adapter", str(adapter), "--dataset", str(data),
            "--out", str(tmp / "cli"), "--max-new-tokens", "8", "--device", "cpu", "-q"]
    r = CliRunner().invoke(app, args, terminal_width=160)
    assert r.exit_code == 0, r.output
    m = json.loads((tmp / "cli" / "metrics.json").read_text())
    assert "pass@1" in r.output and f"{100 * m['score']:.2f}%" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "problems; wrote" in r.output  # -q: the result line only
    assert m["lora_modules"] == 14 and m["sampling"]["max_new_tokens"] == 8
    r = CliRunner().invoke(app, args, terminal_width=160)
    assert r.exit_code == 0 and "already done" in r.output
    assert "wrote" not in r.output and f"problems; in {tmp / 'cli'}" in r.output  # it wrote nothing (docs audit)


def test_bundled_tiny_model_bf16_and_nvfp4(tmp_path):
    """The bundled pretrained model on its own task: it solves a real fraction, in bf16 and NVFP4."""
    from qerl_cli.assets import tiny_model_dir, tiny_task_file
    from qerl_cli.quantize import QuantizeConfig, quantize

    kw = dict(prompt_template="{prompt}", max_new_tokens=48, max_problems=20)
    bf16 = _eval(tiny_model_dir(), tiny_task_file("test"), tmp_path / "bf16", **kw)["metrics"]
    quantize(QuantizeConfig(src=tiny_model_dir(), out=tmp_path / "q", device="cpu", progress=False))
    fp4 = _eval(tmp_path / "q", tiny_task_file("test"), tmp_path / "fp4", **kw)["metrics"]
    for m in (bf16, fp4):
        samples = [json.loads(x) for x in (tmp_path / ("bf16" if m is bf16 else "fp4") / "samples.jsonl").read_text().splitlines()]
        assert m["score"] == pytest.approx(sum(s["correct"] for s in samples) / 20)
        assert m["counts"]["no_answer"] == 0 and m["scored_with"] == {"gsm8k": 20}
        # the full test split scores 41% (bf16) / 38% (NVFP4) greedy (docs/merge-eval.md); a broken
        # prompt, scorer or quantized path would give ~0
        assert 0.2 <= m["score"] <= 0.7, m["score"]


def test_stop_strings_end_completions(tmp_path):
    from qerl_cli.assets import tiny_model_dir, tiny_task_file

    m = _eval(tiny_model_dir(), tiny_task_file("test"), tmp_path / "s", prompt_template="{prompt}",
              max_problems=3, stop=("=",))["metrics"]
    samples = [json.loads(x) for x in (tmp_path / "s" / "samples.jsonl").read_text().splitlines()]
    assert m["sampling"]["stop"] == ["="]
    # the model writes "21+8=29. ..." : cut before the first "=", so no final answer is given
    assert all("=" not in s["completion"] and s["finish_reason"] == "stop" for s in samples), samples
    assert m["counts"]["no_answer"] == 3 and m["score"] == 0.0
