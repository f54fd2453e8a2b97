"""Fixtures for train-step tests: a tiny NVFP4 model, its fp32 dequantized twin, hand-made shards."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
from qerl_kernels import reference
from safetensors import safe_open
from safetensors.torch import save_file

from qerl_cli.hashing import model_hash
from qerl_cli.shards import make_record, shard_name, write_records


def quantized_tiny(root: Path, **kw) -> tuple[Path, Path]:
    """(dense HF dir, NVFP4 QDIR) of a tiny random qwen2 model."""
    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.helpers import make_tiny_hf_model

    src = make_tiny_hf_model(root, arch="qwen2", hidden=64, layers=2, vocab=384, init_std=0.05, **kw)
    qdir = root / "q"
    quantize(QuantizeConfig(src=src, out=qdir, device="cpu", progress=False))
    return src, qdir


def dequantized_twin(qdir: Path, out: Path) -> Path:
    """An fp32 plain HF dir whose Linear weights are the exact dequantized NVFP4 weights.

    Written here with the reference decoder (not qerl's merge) so comparisons against it are
    independent of the code under test.
    """
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in sorted(qdir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    dense = {}
    for k, t in tensors.items():
        if k.endswith(".weight_packed"):
            m = k[: -len(".weight_packed")]
            dense[m + ".weight"] = reference.dequantize(t, tensors[m + ".weight_scale"], tensors[m + ".weight_global_scale"],
                                                        torch.float32)
        elif k.endswith((".weight_scale", ".weight_global_scale")):
            continue
        else:
            dense[k] = t.float()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (qdir / name).exists():
            (out / name).write_bytes((qdir / name).read_bytes())
    return out


def make_shard(out: Path, base_hash: str, *, adapter_hash=None, step=0, groups=3, per_group=4, seed=0,
               vocab=384, temperature=0.8, noise=None, truncate_every=3, logprob_fn=None) -> Path:
    """A shard dir with ``groups`` x ``per_group`` completions of varied lengths and rewards.

    Sampling log-probs default to a fixed pseudo-random value near log(1/vocab) so that TIS
    weights land on both sides of the cap; ``logprob_fn(prompt, completion)`` overrides them.
    """
    rnd = random.Random(seed)
    recs = []
    for g in range(groups):
        prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randint(3, 7))]
        for i in range(per_group):
            comp = [rnd.randrange(3, vocab) for _ in range(rnd.randint(1, 9))]
            if logprob_fn is not None:
                lps = logprob_fn(prompt, comp)
            else:
                lps = [-math.log(vocab) + rnd.uniform(-1.5, 1.5) for _ in comp]
            reward = float(rnd.choice([0.0, 0.5, 1.0])) if g != 1 else 1.0  # group 1: zero variance
            recs.append(make_record(
                prompt_id=f"p{g}", group_id=f"s{step}-g{g}", prompt="x", prompt_token_ids=prompt,
                completion_token_ids=comp, completion="y", logprobs=lps,
                finish_reason="length" if (truncate_every and (g * per_group + i) % truncate_every == 0) else "stop",
                rewards={"r": reward}, reward=reward, answer=None, step=step,
                policy={"base": base_hash, "adapter": adapter_hash},
                sampling={"temperature": temperature, "top_p": 1.0, "top_k": 0, "seed": seed},
                noise=noise or {"sigma": 0.0, "seed": 0, "step": step, "norms": []}, engine="test"))
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / shard_name(0, 1), recs)
    return out


def base_hash_of(d: Path) -> str:
    return model_hash(d)


def quantized_tiny_with_hash(root: Path) -> tuple[Path, str]:
    """(NVFP4 QDIR of ``quantized_tiny``, its base hash): what train-step tests build shards against."""
    _, q = quantized_tiny(root)
    return q, base_hash_of(q)


def quick_step(q: Path, shard: Path, out: Path, **kw):
    """One small train-step on CPU (rank 4, 400-token micro-batches, lr 1e-3 unless ``kw`` says otherwise)."""
    from qerl_cli.train_step import TrainStepConfig, train_step

    kw = dict(dict(micro_batch_tokens=400, lora_rank=4, lr=1e-3), **kw)
    return train_step(TrainStepConfig(model=q, shards=[str(shard)], out=out, progress=False, **kw))
