"""``--engine vllm``: the rollout engine on vLLM, with AQN noise applied inside vLLM's own model.

vLLM reads a compressed-tensors NVFP4 QDIR natively and serves the adapter as a LoRA request, so
this wrapper only has to (1) turn qerl's sampling flags into a ``vllm.SamplingParams`` asking for
the sampled token's log-probability under the *processed* distribution (``logprobs_mode=
"processed_logprobs"``: after temperature and top-k/top-p, as training's importance correction
needs) and a per-request seed, and (2) put the AQN noise where vLLM's forward reads it.

(2) is the part the QeRL reference code got silently wrong: it searched the vLLM model for Hugging
Face RMSNorm classes, found none, and applied no noise. Here a function is shipped into every
vLLM worker with ``LLM.apply_model`` and run on the worker's ``nn.Module``: it matches vLLM's own
``vllm.model_executor.layers.layernorm.RMSNorm`` modules by their checkpoint names
(``model.layers.{i}.input_layernorm`` / ``post_attention_layernorm``), keeps a clean copy of each
weight the first time, and writes ``w_clean + Z`` in place (in place, so captured CUDA graphs see
it; from the clean copy, so noise never accumulates). Z comes from ``qerl_cli.aqn.noise_vector``:
the same seeded CPU generator as the native engine and ``train-step``. The function returns how
many norms it changed, and fewer than 2 per decoder layer is an error rather than a silent no-op.
vLLM's norm weights are bf16, so w_clean + Z is rounded there (the native engine adds an fp32 Z in
its kernel): the shard's noise record says so (``rounded_to``) and train-step rounds the same way.

Trade-off against the native engine: vLLM is faster at large batch and serves bigger models, but
its kernels differ from the ones training uses, so the behaviour policy and training policy
differ slightly more (the per-token logprobs recorded here keep TIS correct regardless).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from qerl_cli.errors import BadInputError

NORM_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|post_attention_layernorm)$")


def _vllm():
    try:
        import vllm
    except ImportError:
        raise BadInputError("--engine vllm needs vLLM, which is not installed", hint="pip install 'qerl[vllm]'") from None
    return vllm


def set_norm_noise(model, sigma: float, run_seed: int, step: int, norm_types: tuple | None = None) -> dict:
    """Runs inside a vLLM worker: set ``w = w_clean + Z`` on every noised RMSNorm.

    Returns ``{"count": norms set, "dtype": their weight dtype, "changed": weight entries the noise
    moved, "entries": all entries}``. vLLM keeps norm weights in the model dtype, so w_clean + Z is
    rounded to it (bf16 spacing near 1 is 2^-7: most of a sigma = 1e-3 noise rounds away); the shard's
    noise record names that dtype and train-step applies the same rounded noise (``aqn.apply_noise``).
    ``norm_types`` defaults to vLLM's own RMSNorm class (a parameter so it can be tested without vLLM).
    """
    import torch

    from qerl_cli.aqn import noise_vector

    if norm_types is None:
        from vllm.model_executor.layers.layernorm import RMSNorm

        norm_types = (RMSNorm,)
    count = changed = entries = 0
    dtype = None
    with torch.no_grad():
        for name, mod in model.named_modules():
            m = NORM_NAME.search(name)
            if m is None or not isinstance(mod, norm_types):
                continue
            w = mod.weight
            clean = getattr(mod, "_qerl_clean_weight", None)
            if clean is None:
                clean = w.detach().clone()
                mod._qerl_clean_weight = clean
            if sigma > 0:
                z = noise_vector(w.shape[0], sigma, run_seed, step, int(m.group(1)), m.group(2))
                w.copy_((clean.float() + z.to(w.device)).to(w.dtype))
                changed += int((w != clean).sum())
            else:
                w.copy_(clean)
            count, entries, dtype = count + 1, entries + w.numel(), str(w.dtype).removeprefix("torch.")
    return {"count": count, "dtype": dtype, "changed": changed, "entries": entries}


# vllm/sampling_params.py raises any temperature in (1e-5, 1e-2) to 1e-2 (_MAX_TEMP) with only a log
# warning: the shard would record the temperature asked for while vLLM sampled at another.
VLLM_MIN_TEMPERATURE = 1e-2
# vllm/config/lora.py: max_lora_rank must be one of these (validation error otherwise, before any rollout).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


# vllm/sampling_params.py (_verify_args, since vLLM PR #44965, 2026-06): a temperature above 2 is an error, raised
# only once the model has loaded; and greedy sampling with n > 1 (_verify_greedy_sampling) too.
VLLM_MAX_TEMPERATURE = 2.0


def check_vllm_temperature(temperature: float, n: int = 1) -> None:
    """Refuse, before vLLM loads the model, what vLLM would change silently or refuse only after loading."""
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise BadInputError(f"--temperature {temperature:g} with --engine vllm: vLLM samples every temperature under "
                            f"{VLLM_MIN_TEMPERATURE:g} at {VLLM_MIN_TEMPERATURE:g}, so the records would name the wrong one",
                            hint=f"pass --temperature 0 (greedy) or >= {VLLM_MIN_TEMPERATURE:g}, or --engine native")
    if temperature > VLLM_MAX_TEMPERATURE:
        raise BadInputError(f"--temperature {temperature:g} with --engine vllm: vLLM refuses temperatures above "
                            f"{VLLM_MAX_TEMPERATURE:g}", hint="lower --temperature, or use --engine native")
    if temperature == 0 and n > 1:
        raise BadInputError(f"--temperature 0 (greedy) with {n} completions per prompt and --engine vllm: vLLM refuses "
                            "greedy sampling of more than one (they would all be the same)",
                            hint="pass --temperature > 0 (a GRPO group needs different completions)")


def check_vllm_device(device: str) -> None:
    """vLLM takes no device: it runs on the first GPU of CUDA_VISIBLE_DEVICES. Refuse a --device it would ignore
    (the stage recorded and printed a device vLLM never used; `cpu` ran vLLM on a GPU at fp32)."""
    if device == "cpu":
        raise BadInputError("--device cpu with --engine vllm: vLLM would ignore it and run on a GPU",
                            hint="use --engine native on CPU")
    m = re.fullmatch(r"cuda:(\d+)", device)
    if m and int(m.group(1)) != 0:
        n = m.group(1)
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if int(n) < len(visible):  # cuda:N counts the visible GPUs: name the GPU it meant
            n = visible[int(n)]
        raise BadInputError(f"--device {device} with --engine vllm: vLLM ignores it and runs on the first visible GPU",
                            hint=f"select the GPU with CUDA_VISIBLE_DEVICES={n} and pass --device cuda")


def use_spawn() -> None:
    """Start vLLM's engine-core process with spawn unless the user chose a method. qerl probes the GPU with
    ``torch.cuda.is_available()`` (``runtime.resolve_device``) before vLLM is imported, which poisons fork
    (torch registers its bad-fork handler there); vLLM forks by default and forces spawn only when
    ``torch.cuda.is_initialized()``, which that probe leaves False: the forked engine core then failed with
    "Cannot re-initialize CUDA in forked subprocess". (vLLM's own guard, PYTORCH_NVML_BASED_CUDA_CHECK=1,
    is set only when vLLM is imported: after qerl's probe.)"""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def allow_function_shipping() -> None:
    """``apply_model`` ships a Python function to vLLM's engine-core process, which vLLM allows only with
    pickle-based serialization on: switch it on, refusing a value the user set to off (vLLM then failed only
    after loading the whole model)."""
    v = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    if v is not None and v.strip().lower() in ("", "0", "false", "no", "off"):
        raise BadInputError(f"VLLM_ALLOW_INSECURE_SERIALIZATION={v!r}: the vLLM engine applies AQN noise through "
                            "vLLM's apply_model, which needs it on", hint="unset it, or use --engine native")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def vllm_max_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``r``."""
    for v in VLLM_LORA_RANKS:
        if v >= r:
            return v
    raise BadInputError(f"the adapter's LoRA rank {r} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})",
                        hint="use --engine native")


def completion_finish(reason: str | None) -> str:
    """vLLM's finish reason -> qerl's; a completion vLLM aborted or failed is never recorded as a stop."""
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM finished a completion with {reason!r} (not a stop or the length limit); "
                       "refusing to record and reward it as finished")


def vllm_sampling_params(*, temperature: float, top_p: float, top_k: int, min_p: float, max_new_tokens: int,
                         stop: Sequence[str], seed: int, stop_token_ids: Sequence[int] = ()) -> dict:
    """qerl sampling flags -> keyword arguments of ``vllm.SamplingParams`` (``n`` is added per call)."""
    check_vllm_temperature(temperature)
    # vLLM >= 0.10 (the extra's floor) reads top_k 0 as "off", like qerl.
    return dict(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p,
                max_tokens=max_new_tokens, stop=list(stop) or None, stop_token_ids=list(stop_token_ids) or None,
                seed=seed, logprobs=0)


def noise_record_extra(results: list[dict], sigma: float, want: int) -> dict:
    """Check ``set_norm_noise``'s per-worker results; -> ``{"rounded_to": dtype, "survived": fraction}``
    for the noise record where vLLM's weights are not fp32, else {}. Raises where noise is missing."""
    counts = [r["count"] for r in results]
    if any(c != want for c in counts):
        raise RuntimeError(f"AQN reached {counts} RMSNorms in the vLLM workers, expected {want} each; "
                           "refusing to roll out with missing noise")
    if sigma <= 0:
        return {}
    dtype = results[0]["dtype"]
    changed, entries = sum(r["changed"] for r in results), sum(r["entries"] for r in results)
    if changed == 0:
        raise BadInputError(f"AQN sigma {sigma:g} changes no weight of vLLM's {dtype} RMSNorms (below their "
                            "resolution): the rollout would carry no noise",
                            hint="raise --aqn-sigma-start/--aqn-sigma-end, or use --engine native (fp32 noise)")
    return {} if dtype == "float32" else {"rounded_to": dtype, "survived": round(changed / entries, 4)}


def per_prompt_sampling(sampling: dict, n: int, num_prompts: int, seeds: list[int] | None = None) -> list[dict]:
    """One ``vllm.SamplingParams``' keywords per prompt, each with a seed of its own, hashed as the native
    engine seeds its rows: from the prompt's own seed in ``seeds``, else from the batch's seed and the
    prompt's index. vLLM seeds completion i of a request with seed + i, so one shared seed would give
    completion i of every prompt in the batch the same random stream: duplicate prompts would get
    identical completions."""
    from qerl_cli.engine.sampler import sequence_seed

    if seeds is not None and len(seeds) != num_prompts:
        raise ValueError(f"{len(seeds)} seeds for {num_prompts} prompts")
    return [dict(sampling, n=n, seed=sequence_seed(sampling["seed"], seeds, p, 0)) for p in range(num_prompts)]


class VLLMEngine:
    """``generate(prompt_ids, sampling_kwargs, n) -> list[list[Completion]]`` on a vLLM ``LLM``."""

    def __init__(self, model_dir: Path, *, adapter_dir: Path | None, dtype: str, max_num_seqs: int,
                 max_model_len: int | None, seed: int, gpu_memory_utilization: float = 0.85,
                 ship_functions: bool = True):
        from qerl_cli.adapters import NORMS, trained_norms
        from qerl_cli.models.loader import check_quant_config

        if adapter_dir is not None and trained_norms(adapter_dir):
            # vLLM's LoRA requests carry only LoRA tensors: sampling would silently use the base's norms.
            raise BadInputError(f"--adapter {adapter_dir} has trained norm weights ({NORMS}), which the vLLM engine "
                                "cannot apply", hint="use --engine native, or serve a qerl merge of the adapter")
        if ship_functions:  # only set_noise (rollout) ships a function; eval needs no pickle serialization
            allow_function_shipping()
        # The checkpoints the native engine takes, no others: vLLM finds a ModelOpt dir by its
        # hf_quant_config.json and serves it as ModelOpt NVFP4 (W4A4 in the vLLM builds that want an input_scale,
        # which qerl's weight-only ModelOpt files lack), so `--format modelopt` reached vLLM while the docs
        # (and the native engine) refused it.
        check_quant_config(Path(model_dir))
        use_spawn()
        vllm = _vllm()
        kw = dict(model=str(model_dir), dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, "auto"),
                  max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=seed,
                  gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs")
        self.lora_request = None
        if adapter_dir is not None:
            from qerl_cli.adapters import read_adapter_spec

            # (one on only some layers, layers_to_transform, too: vLLM applies each pair in the file and resets the LoRA
            # of a module without one, LoRAModelManager.activate_adapter, as PEFT runs it; pairs PEFT would not load
            # are refused here)
            spec = read_adapter_spec(adapter_dir, base_dir=model_dir)  # vLLM applies a head pair PEFT drops
            kw.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(spec.r), max_loras=1)
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest("qerl-adapter", 1, str(adapter_dir))
        from qerl_cli.models.config import ModelConfig

        self.num_layers = ModelConfig.from_dir(Path(model_dir)).num_layers
        self.llm = vllm.LLM(**kw)

    def set_noise(self, sigma: float, run_seed: int, step: int) -> dict:
        """Noise vLLM's norms; returns what the shard's noise record adds (``noise_record_extra``)."""
        results = self.llm.apply_model(functools.partial(set_norm_noise, sigma=sigma, run_seed=run_seed, step=step))
        return noise_record_extra(results, sigma, 2 * self.num_layers)

    def generate(self, prompt_ids: list[list[int]], sampling: dict, n: int, progress: Callable | None = None,
                 seeds: list[int] | None = None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from qerl_cli.engine import Completion

        sp = [SamplingParams(**kw) for kw in per_prompt_sampling(sampling, n, len(prompt_ids), seeds)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], sp,
                                 lora_request=self.lora_request, use_tqdm=False)
        groups = []
        for out in outs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                if not ids:  # vLLM reports a request it ignored (e.g. too long a prompt) as finished by length
                    raise RuntimeError(f"vLLM returned no tokens (finish reason {c.finish_reason!r}) for a prompt of "
                                       f"{len(out.prompt_token_ids or [])} tokens; refusing to record an empty completion")
                lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
                group.append(Completion(token_ids=ids, logprobs=lps, text=c.text,
                                        finish_reason=completion_finish(c.finish_reason)))
            groups.append(group)
        return groups
