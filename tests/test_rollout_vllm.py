"""--engine vllm: the in-worker AQN noise function (CPU, no vLLM needed) and, where vLLM exists, a run."""

import importlib.util

import pytest
import torch
from torch import nn

from qerl_cli.aqn import noise_vector
from qerl_cli.engine_vllm import noise_record_extra, set_norm_noise, vllm_sampling_params
from qerl_cli.errors import BadInputError

HAS_VLLM = importlib.util.find_spec("vllm") is not None


class FakeVllmRMSNorm(nn.Module):  # stands in for vllm.model_executor.layers.layernorm.RMSNorm
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))


class HFStyleRMSNorm(nn.Module):  # a class the function must NOT match
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


def fake_vllm_model(layers=3, d=16):
    torch.manual_seed(0)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.input_layernorm = FakeVllmRMSNorm(d)
        layer.post_attention_layernorm = FakeVllmRMSNorm(d)
        layer.q_norm = FakeVllmRMSNorm(d)  # Qwen3's q/k norms are not AQN targets
        model.model.layers.append(layer)
    model.model.norm = FakeVllmRMSNorm(d)
    return model


def test_noise_lands_on_vllm_norms_as_clean_plus_z():
    model = fake_vllm_model()
    clean = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = set_norm_noise(model, 0.01, run_seed=7, step=3, norm_types=(FakeVllmRMSNorm,))
    assert res["count"] == 6 and res["dtype"] == "float32" and res["entries"] == 6 * 16 and res["changed"] > 0
    for i, layer in enumerate(model.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(layer, name).weight
            z = noise_vector(16, 0.01, 7, 3, i, name)  # the native engine's and train-step's vector
            torch.testing.assert_close(w.detach(), clean[f"model.layers.{i}.{name}.weight"] + z)
        torch.testing.assert_close(layer.q_norm.weight.detach(), clean[f"model.layers.{i}.q_norm.weight"])
    torch.testing.assert_close(model.model.norm.weight.detach(), clean["model.norm.weight"])
    # applying again (next step) starts from the clean weight: no accumulation
    set_norm_noise(model, 0.01, run_seed=7, step=4, norm_types=(FakeVllmRMSNorm,))
    w = model.model.layers[0].input_layernorm.weight.detach()
    torch.testing.assert_close(w, clean["model.layers.0.input_layernorm.weight"] + noise_vector(16, 0.01, 7, 4, 0, "input_layernorm"))
    # sigma 0 restores the clean weights exactly
    set_norm_noise(model, 0.0, run_seed=7, step=5, norm_types=(FakeVllmRMSNorm,))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), clean[n])


def test_other_norm_classes_are_not_matched():
    model = fake_vllm_model(layers=1)
    model.model.layers[0].input_layernorm = HFStyleRMSNorm(16)
    # only the post_attention_layernorm is a "vLLM" norm now: the count exposes the miss
    assert set_norm_noise(model, 0.01, 0, 1, norm_types=(FakeVllmRMSNorm,))["count"] == 1


def test_bf16_norm_noise_is_recorded_and_train_step_rounds_the_same_way():
    # vLLM keeps norm weights in bf16: w_clean + Z is rounded there. The record says so, and
    # aqn.rounded_noise (what train-step applies) gives back exactly the weights vLLM sampled with.
    from qerl_cli.aqn import rounded_noise

    model = fake_vllm_model(d=512).to(torch.bfloat16)
    clean = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = set_norm_noise(model, 1e-3, run_seed=7, step=3, norm_types=(FakeVllmRMSNorm,))
    assert res["dtype"] == "bfloat16" and 0 < res["changed"] < res["entries"]  # partly rounded away
    extra = noise_record_extra([res], 1e-3, want=6)
    assert extra == {"rounded_to": "bfloat16", "survived": round(res["changed"] / res["entries"], 4)}
    for i, layer in enumerate(model.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            w0 = clean[f"model.layers.{i}.{name}.weight"]
            z = rounded_noise(noise_vector(512, 1e-3, 7, 3, i, name), w0.float(), torch.bfloat16)
            assert torch.equal(getattr(layer, name).weight.detach().float(), w0.float() + z)
    assert noise_record_extra([dict(res, dtype="float32")], 1e-3, want=6) == {}
    assert noise_record_extra([res], 0.0, want=6) == {}
    with pytest.raises(RuntimeError, match="expected 6"):
        noise_record_extra([dict(res, count=5)], 1e-3, want=6)
    # a sigma below bf16's resolution moves nothing: refused, not rolled out as if noised
    tiny = set_norm_noise(model, 1e-6, run_seed=7, step=3, norm_types=(FakeVllmRMSNorm,))
    assert tiny["changed"] == 0
    with pytest.raises(BadInputError, match="changes no weight"):
        noise_record_extra([tiny], 1e-6, want=6)


def test_sampling_params_mapping():
    kw = vllm_sampling_params(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, max_new_tokens=32, stop=(), seed=3)
    assert kw == dict(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, max_tokens=32, stop=None, stop_token_ids=None,
                      seed=3, logprobs=0)
    kw = vllm_sampling_params(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=8, stop=("\n\n",),
                              stop_token_ids=(7,), seed=0)
    assert (kw["stop"], kw["stop_token_ids"]) == (["\n\n"], [7])


def test_each_prompt_gets_its_own_seed():
    # vLLM seeds completion i of a request with seed + i: one shared seed would give completion i of
    # every prompt the same random stream, and duplicate prompts identical completions.
    from qerl_cli.engine_vllm import per_prompt_sampling

    kw = vllm_sampling_params(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, max_new_tokens=32, stop=(), seed=3)
    per = per_prompt_sampling(kw, n=8, num_prompts=50)
    seeds = [p["seed"] for p in per]
    # n = 8 children each: their seed ranges seed .. seed + 7 must not overlap across prompts
    assert len({s + i for s in seeds for i in range(8)}) == 50 * 8
    assert all(0 <= s < 2**63 - 8 for s in seeds)
    assert all({k: v for k, v in p.items() if k not in ("seed", "n")} == {k: v for k, v in kw.items() if k != "seed"}
               and p["n"] == 8 for p in per)
    assert per_prompt_sampling(kw, 8, 50) == per  # reproducible
    assert per_prompt_sampling(dict(kw, seed=4), 8, 50)[0]["seed"] != seeds[0]
    # A seed per prompt (what rollout passes): a prompt's request seed follows from its own seed alone.
    mine = [1000 + 7 * p for p in range(50)]
    own = [p["seed"] for p in per_prompt_sampling(kw, 8, 50, mine)]
    assert own[7:9] == [p["seed"] for p in per_prompt_sampling(dict(kw, seed=99), 8, 2, mine[7:9])]
    assert len({s + i for s in own for i in range(8)}) == 50 * 8
    with pytest.raises(ValueError, match="3 seeds for 50 prompts"):
        per_prompt_sampling(kw, 8, 50, mine[:3])


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'qerl[vllm]'); the vLLM engine is untested here")
def test_vllm_api_we_rely_on_exists():
    """Without a GPU: the vLLM names and arguments engine_vllm uses are the installed vLLM's."""
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.model_executor.layers.layernorm import RMSNorm

    from qerl_cli.engine_vllm import per_prompt_sampling

    kw = vllm_sampling_params(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, max_new_tokens=8, stop=("\n",), seed=1)
    sp = vllm.SamplingParams(**per_prompt_sampling(kw, 2, 1)[0])
    assert sp.n == 2 and sp.logprobs == 0 and sp.seed == per_prompt_sampling(kw, 2, 1)[0]["seed"]
    assert callable(getattr(vllm.LLM, "apply_model", None))
    assert TokensPrompt(prompt_token_ids=[1, 2])["prompt_token_ids"] == [1, 2]
    assert LoRARequest("a", 1, "/tmp").lora_int_id == 1 and isinstance(RMSNorm, type)
    # the LLM(...) keywords VLLMEngine passes reach EngineArgs (a review of vLLM's source found no check of them)
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"logprobs_mode", "enable_lora", "max_lora_rank", "max_loras", "max_num_seqs", "max_model_len", "seed",
            "gpu_memory_utilization", "dtype"} <= fields
    with pytest.raises(Exception):  # noqa: B017 - greedy with n > 1: what check_vllm_temperature refuses first
        vllm.SamplingParams(n=2, temperature=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'qerl[vllm]'); the vLLM engine is untested here")
def test_vllm_rollout_end_to_end(tmp_path):
    import json

    from qerl_cli.assets import tiny_model_dir, tiny_task_file
    from qerl_cli.rollout import RolloutConfig, rollout
    from qerl_cli.shards import read_records

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(json.loads(x)) + "\n" for x in tiny_task_file("test").read_text().splitlines()[:8]))
    res = rollout(RolloutConfig(model=tiny_model_dir(), prompts=prompts, out=tmp_path / "o", engine="vllm",
                                num_generations=4, max_new_tokens=32, aqn_sigma_start=1e-2, aqn_sigma_end=1e-4,
                                total_steps=10, step=5, progress=False))
    recs = read_records(tmp_path / "o")
    assert len(recs) == 32 and all(r["engine"] == "vllm" for r in recs)
    assert all(len(r["logprobs"]) == len(r["completion_token_ids"]) for r in recs)
    assert res["summary"]["sigma"] > 0


def test_adapter_with_trained_norms_is_refused_before_vllm_loads(tmp_path):
    # vLLM's LoRA request carries no norm weights: sampling would silently use the base's (runs without vLLM).
    from qerl_cli.engine_vllm import VLLMEngine
    from qerl_cli.errors import BadInputError

    (tmp_path / "norms.safetensors").write_bytes(b"")
    with pytest.raises(BadInputError, match="has trained norm weights"):
        VLLMEngine(tmp_path, adapter_dir=tmp_path, dtype="bf16", max_num_seqs=1, max_model_len=None, seed=0)


def test_vllm_limits_are_refused_or_rounded_before_vllm_loads(tmp_path):
    # From vLLM's source (2026-11-26 review): SamplingParams raises any temperature in (1e-5, 1e-2) to
    # 1e-2 with a log line only (the records would name another temperature than the one sampled);
    # max_lora_rank must be one of (8, 16, 32, 64, 128, 256, 320, 512) (r = 12 failed vLLM's start);
    # finish reasons "abort" / "error" were recorded as stops.
    from qerl_cli.engine_vllm import completion_finish, vllm_max_lora_rank
    from qerl_cli.evaluate import EvalConfig
    from qerl_cli.rollout import RolloutConfig, rollout

    for t in (1e-3, 0.0099):
        with pytest.raises(BadInputError, match="vLLM samples every temperature under 0.01"):
            vllm_sampling_params(temperature=t, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=4, stop=(), seed=0)
        with pytest.raises(BadInputError, match="with --engine vllm"):
            rollout(RolloutConfig(model=tmp_path, prompts=tmp_path / "p.jsonl", out=tmp_path / "o", engine="vllm",
                                  temperature=t, progress=False))
        with pytest.raises(BadInputError, match="with --engine vllm"):
            EvalConfig(model=tmp_path, dataset=tmp_path / "d.jsonl", out=tmp_path / "e", engine="vllm", temperature=t)
    assert vllm_sampling_params(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=4, stop=(),
                                seed=0)["temperature"] == 0.0
    assert [vllm_max_lora_rank(r) for r in (1, 8, 12, 16, 48, 300, 512)] == [8, 8, 16, 16, 64, 320, 512]
    with pytest.raises(BadInputError, match="exceeds vLLM's largest"):
        vllm_max_lora_rank(513)
    assert completion_finish("stop") == "stop" and completion_finish("length") == "length"
    for bad in ("abort", "error", None):
        with pytest.raises(RuntimeError, match="refusing to record"):
            completion_finish(bad)


def test_what_vllm_refuses_after_loading_is_refused_before_it(tmp_path, monkeypatch):
    # From vLLM's source (2026-11-27 review): SamplingParams refuses a temperature above 2 (PR #44965) and greedy
    # sampling with n > 1, and apply_model fails with pickle serialization off: each only after the model loaded.
    from qerl_cli.engine_vllm import VLLMEngine, check_vllm_temperature
    from qerl_cli.rollout import RolloutConfig, rollout

    def cfg(**kw):
        return RolloutConfig(model=tmp_path, prompts=tmp_path / "p.jsonl", out=tmp_path / "o", engine="vllm",
                             progress=False, **kw)

    with pytest.raises(BadInputError, match="vLLM refuses temperatures above 2"):
        rollout(cfg(temperature=2.5))
    with pytest.raises(BadInputError, match="--temperature 0 .* with 8 completions per prompt and --engine vllm"):
        rollout(cfg(temperature=0.0))  # G defaults to 8
    check_vllm_temperature(2.0, 8)
    check_vllm_temperature(0.0, 1)
    for off in ("0", "false", ""):
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", off)
        with pytest.raises(BadInputError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
            VLLMEngine(tmp_path, adapter_dir=None, dtype="bf16", max_num_seqs=1, max_model_len=None, seed=0)


def _fake_vllm(monkeypatch, seen: dict):
    """The stand-in ``vllm`` (tests/vllm_standin.py; no vLLM here), recording the environment ``LLM(...)`` starts under."""
    from tests import vllm_standin

    vllm = vllm_standin.install(monkeypatch)

    class LLM(vllm.LLM):
        def __init__(self, model, **kw):
            super().__init__(model, **kw)
            seen.update(kw=kw, method=self.environ["VLLM_WORKER_MULTIPROC_METHOD"],
                        pickle=self.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"])

    monkeypatch.setattr(vllm, "LLM", LLM)
    return vllm


def test_vllm_engine_core_is_spawned_not_forked(monkeypatch):
    # resolve_device's torch.cuda.is_available() runs before vLLM is imported and poisons fork (torch), while
    # vLLM forks its engine core unless torch.cuda.is_initialized(): the child died with "Cannot re-initialize
    # CUDA in forked subprocess". The engine now asks for spawn, keeping a method the user set.
    from qerl_cli.assets import tiny_model_dir
    from qerl_cli.engine_vllm import VLLMEngine

    seen: dict = {}
    _fake_vllm(monkeypatch, seen)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    VLLMEngine(tiny_model_dir(), adapter_dir=None, dtype="bf16", max_num_seqs=1, max_model_len=None, seed=0)
    assert seen["method"] == "spawn" and seen["pickle"] == "1"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    VLLMEngine(tiny_model_dir(), adapter_dir=None, dtype="bf16", max_num_seqs=1, max_model_len=None, seed=0)
    assert seen["method"] == "fork"


def test_eval_engine_needs_no_pickle_serialization(monkeypatch):
    # Only rollout ships a function (the AQN noise) to vLLM; eval was refused under
    # VLLM_ALLOW_INSECURE_SERIALIZATION=0 with a message about AQN noise, and otherwise switched pickle on.
    from qerl_cli.assets import tiny_model_dir
    from qerl_cli.engine_vllm import VLLMEngine

    seen: dict = {}
    _fake_vllm(monkeypatch, seen)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    VLLMEngine(tiny_model_dir(), adapter_dir=None, dtype="bf16", max_num_seqs=1, max_model_len=None, seed=0,
               ship_functions=False)
    assert seen["pickle"] == "0"


def test_eval_asks_its_engine_for_no_pickle_serialization(monkeypatch, tmp_path):
    # the call site: VLLMEngine(ship_functions=False) alone passed with eval still switching pickle on
    from qerl_cli.assets import tiny_model_dir
    from qerl_cli.evaluate import EvalConfig, vllm_generator

    seen: dict = {}
    _fake_vllm(monkeypatch, seen)
    cfg = EvalConfig(model=tiny_model_dir(), dataset=tmp_path / "d.jsonl", out=tmp_path / "e", engine="vllm")
    try:
        vllm_generator(cfg, None, "bf16", 64)
    except AttributeError:  # the stand-in has no tokenizer to read past the engine
        pass
    assert seen["pickle"] is None and seen["method"] == "spawn"


def test_the_device_hint_names_the_gpu_cuda_n_meant(monkeypatch):
    from qerl_cli.engine_vllm import check_vllm_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(BadInputError) as e:
        check_vllm_device("cuda:1")
    assert "CUDA_VISIBLE_DEVICES=5 " in e.value.hint
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(BadInputError) as e:
        check_vllm_device("cuda:1")
    assert "CUDA_VISIBLE_DEVICES=1 " in e.value.hint


def test_a_device_vllm_would_ignore_is_refused(tmp_path):
    # vLLM takes no device argument: --device cuda:1 ran on the first visible GPU (recorded as cuda:1), cpu on a GPU.
    from qerl_cli.engine_vllm import check_vllm_device
    from qerl_cli.evaluate import EvalConfig
    from qerl_cli.rollout import RolloutConfig, rollout

    for ok in ("auto", "cuda", "cuda:0"):
        check_vllm_device(ok)
    with pytest.raises(BadInputError, match="CUDA_VISIBLE_DEVICES=1"):
        rollout(RolloutConfig(model=tmp_path, prompts=tmp_path / "p.jsonl", out=tmp_path / "o", engine="vllm",
                              device="cuda:1", progress=False))
    with pytest.raises(BadInputError, match="--device cpu with --engine vllm"):
        EvalConfig(model=tmp_path, dataset=tmp_path / "d.jsonl", out=tmp_path / "e", engine="vllm", device="cpu")


def _vllm_rollout(tmp_path, monkeypatch, model, **kw):
    """rollout --engine vllm on the stand-in, as on a GPU machine (the stage's device probe says cuda)."""
    import qerl_cli.rollout as rollout_mod
    from qerl_cli.assets import tiny_task_file

    monkeypatch.setattr(rollout_mod, "resolve_device", lambda device: "cuda")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(x + "\n" for x in tiny_task_file("test").read_text().splitlines()[:3]))
    return rollout_mod.rollout(rollout_mod.RolloutConfig(model=model, prompts=prompts, out=tmp_path / "o", engine="vllm",
                                                         num_generations=4, max_new_tokens=6, progress=False, **kw))


def test_vllm_rollout_runs_against_the_stand_ins_api(tmp_path, monkeypatch):
    # The whole --engine vllm path (LLM(...), apply_model, SamplingParams, generate, the outputs) against a stand-in
    # that has vLLM's shapes and refusals (tests/vllm_standin.py): until now only the GPU test above ran it.
    from qerl_cli.assets import tiny_model_dir
    from qerl_cli.shards import read_records

    seen: dict = {}
    vllm = _fake_vllm(monkeypatch, seen)
    res = _vllm_rollout(tmp_path, monkeypatch, tiny_model_dir(), aqn_sigma_start=1e-2, aqn_sigma_end=1e-2,
                        total_steps=20, step=5)
    recs = read_records(tmp_path / "o")
    assert len(recs) == 12 and all(len(r["logprobs"]) == len(r["completion_token_ids"]) for r in recs)
    assert seen["kw"]["logprobs_mode"] == "processed_logprobs" and seen["pickle"] == "1"
    call = vllm.LLM.instances[-1].generate_calls[0]
    assert [sp.n for sp in call["params"]] == [4] * 3 and all(sp.logprobs == 0 for sp in call["params"])
    assert len({sp.seed for sp in call["params"]}) == 3 and call["lora_request"] is None
    assert recs[0]["noise"]["rounded_to"] == "bfloat16" and res["summary"]["sigma"] > 0
    norms = vllm.LLM.instances[-1].workers[0].model.layers[0].input_layernorm
    assert not torch.equal(norms.weight, norms._qerl_clean_weight)  # the noise reached vLLM's own norms


def test_a_modelopt_checkpoint_is_refused_by_the_vllm_engine_too(tmp_path, monkeypatch):
    # docs/quantize.md: of qerl's stages only merge reads `--format modelopt`. The native engine refused it (its loader),
    # but --engine vllm handed it to vLLM, which finds a ModelOpt checkpoint by its hf_quant_config.json
    # (vLLM's docs/features/quantization/modelopt.md) and serves NVFP4 as ModelOpt's W4A4 (qerl's is weight-only).
    import shutil

    from qerl_cli.assets import tiny_model_dir
    from qerl_cli.evaluate import EvalConfig, vllm_generator

    seen: dict = {}
    _fake_vllm(monkeypatch, seen)
    mo = tmp_path / "mo"
    shutil.copytree(tiny_model_dir(), mo)
    (mo / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4", "group_size": 16}}')
    with pytest.raises(BadInputError, match="a ModelOpt checkpoint"):
        _vllm_rollout(tmp_path, monkeypatch, mo)
    cfg = EvalConfig(model=mo, dataset=tmp_path / "d.jsonl", out=tmp_path / "e", engine="vllm")
    with pytest.raises(BadInputError, match="a ModelOpt checkpoint"):
        vllm_generator(cfg, None, "bf16", 64)
    assert "kw" not in seen  # refused before vLLM started


def test_vllm_rollout_takes_an_adapter_on_some_layers(tmp_path, monkeypatch):
    # read_adapter_spec refused an adapter with layers_to_transform before vLLM started. vLLM applies each pair in the
    # file and resets the LoRA of a module without one (LoRAModelManager.activate_adapter), as PEFT runs it; the pairs
    # are the ones PEFT wraps (read_adapter_spec refuses others), so the file is handed over as it is.
    import peft
    import transformers

    from qerl_cli.assets import tiny_model_dir

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              layers_to_transform=[1])).save_pretrained(tmp_path / "top")
    seen: dict = {}
    vllm = _fake_vllm(monkeypatch, seen)
    _vllm_rollout(tmp_path, monkeypatch, tiny_model_dir(), adapter=tmp_path / "top")
    assert seen["kw"]["enable_lora"] and seen["kw"]["max_lora_rank"] == 8
    assert vllm.LLM.instances[-1].generate_calls[0]["lora_request"].lora_path == str(tmp_path / "top")
