"""A stand-in ``vllm`` package for the tests (vLLM is not installed here; review of vLLM's source, 2026-11-27).

It has the shapes of the vLLM API that ``qerl_cli.engine_vllm`` uses, as vLLM's source has them, and refuses
what a real vLLM refuses, so that a call vLLM would reject fails here too:

- ``LLM(model, **kwargs)``: ``kwargs`` must be ``EngineArgs`` fields (``vllm/entrypoints/llm.py`` passes them
  to ``EngineArgs(**kwargs)``); ``logprobs_mode`` one of ``vllm/config/model.py``'s ``LogprobsMode``;
  ``max_lora_rank`` one of ``vllm/config/lora.py``'s ``MaxLoRARanks``.
- ``LLM.apply_model(fn)``: ``vllm/v1/engine/llm_engine.py`` sends ``fn`` through ``collective_rpc``, which
  (engine core in another process, ``VLLM_ENABLE_V1_MULTIPROCESSING`` on by default) msgpack-encodes it:
  ``vllm/v1/serial_utils.py`` raises TypeError unless ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (``vllm/envs.py``:
  ``bool(int(...))``), then pickles it; the worker runs ``fn(self.get_model())``
  (``vllm/v1/worker/worker_base.py``) and each worker's result comes back in a list.
- ``LLM.generate(prompts, sampling_params, *, use_tqdm, lora_request, ...)``: a list of sampling params must
  match the prompts; a LoRA request needs ``enable_lora``; each ``RequestOutput.outputs`` holds ``n``
  ``CompletionOutput`` (``vllm/outputs.py``) with ``logprobs[t]`` a ``{token_id: Logprob}`` holding the
  sampled token (``logprobs=0``).
- ``SamplingParams(**kw)``: unknown fields are a TypeError (a msgspec Struct); ``_verify_args`` and the
  temperature rules of ``vllm/sampling_params.py``.
"""

from __future__ import annotations

import importlib.machinery
import os
import pickle
import random
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# vllm/engine/arg_utils.py EngineArgs: the fields qerl passes, and the others a test might.
ENGINE_ARGS = {"model", "dtype", "seed", "max_num_seqs", "max_model_len", "gpu_memory_utilization", "logprobs_mode",
               "enable_lora", "max_lora_rank", "max_loras", "enforce_eager", "quantization", "tokenizer",
               "tensor_parallel_size", "worker_extension_cls", "enable_prefix_caching", "disable_log_stats"}
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DTYPES = {"auto": torch.bfloat16, "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float": torch.float32, "float32": torch.float32}
SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens",
                   "min_tokens", "logprobs", "prompt_logprobs", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output", "detokenize", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "output_kind"}


class SamplingParams:
    def __init__(self, **kw):
        unknown = set(kw) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"Unexpected keyword arguments {sorted(unknown)}")
        self.n, self.temperature, self.top_p, self.top_k, self.min_p = 1, 1.0, 1.0, 0, 0.0
        self.seed, self.stop, self.stop_token_ids, self.max_tokens, self.logprobs = None, None, None, 16, None
        self.__dict__.update(kw)
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if 0 < self.temperature < 1e-2:
            self.temperature = 1e-2  # _MAX_TEMP, with a log line only
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.temperature < 1e-5 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class LoRARequest:  # vllm/lora/request.py: (lora_name, lora_int_id, lora_path)
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class RMSNorm(nn.Module):  # vllm/model_executor/layers/layernorm.py
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))


def _worker_model(config: dict, dtype: torch.dtype) -> nn.Module:
    """vLLM's module tree for a Llama/Qwen-style decoder: its own RMSNorm class at the checkpoint's names."""
    torch.manual_seed(0)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for _ in range(config["num_hidden_layers"]):
        layer = nn.Module()
        layer.input_layernorm = RMSNorm(config["hidden_size"])
        layer.post_attention_layernorm = RMSNorm(config["hidden_size"])
        with torch.no_grad():
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.add_(0.1 * torch.randn(config["hidden_size"]))
        model.model.layers.append(layer)
    model.model.norm = RMSNorm(config["hidden_size"])
    return model.to(dtype)


class LLM:
    instances: list = []

    def __init__(self, model: str, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {kwargs['logprobs_mode']!r}")
        if kwargs.get("enable_lora") and kwargs.get("max_lora_rank", 16) not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank {kwargs['max_lora_rank']} is not one of {MAX_LORA_RANKS}")
        self.model_dir, self.kwargs = Path(model), kwargs
        self.config = __import__("json").loads((self.model_dir / "config.json").read_text())
        dtype = DTYPES[kwargs.get("dtype", "auto")]
        self.environ = {k: os.environ.get(k) for k in ("VLLM_WORKER_MULTIPROC_METHOD",
                                                         "VLLM_ALLOW_INSECURE_SERIALIZATION")}
        self.workers = [_worker_model(self.config, dtype)]
        self.generate_calls: list[dict] = []
        LLM.instances.append(self)

    def apply_model(self, func):
        if not bool(int(os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0"))):
            raise TypeError(f"Object of type {type(func)} is not serializable. Set VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
                            "to allow fallback to pickle-based serialization.")
        func = pickle.loads(pickle.dumps(func))  # to the engine-core process
        return [func(model) for model in self.workers]

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None):
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and sampling_params ({len(params)}) must be the same.")
        if lora_request is not None and not self.kwargs.get("enable_lora"):
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
        self.generate_calls.append(dict(prompts=prompts, params=params, lora_request=lora_request))
        return [RequestOutput(str(i), None, list(p["prompt_token_ids"]), None, self._complete(p["prompt_token_ids"], sp))
                for i, (p, sp) in enumerate(zip(prompts, params))]

    def _complete(self, prompt_ids, sp) -> list[CompletionOutput]:
        eos = self.config.get("eos_token_id")
        outs = []
        for i in range(sp.n):  # vllm/v1/engine/parallel_sampling.py: child i samples with seed + i
            rng = random.Random(None if sp.seed is None else sp.seed + i)
            ids = [rng.randrange(2, 100) for _ in range(sp.max_tokens)]
            finish, stop = "length", None
            if rng.random() < 0.5:
                ids[rng.randrange(len(ids))] = eos
                ids = ids[:ids.index(eos) + 1]
                finish, stop = "stop", None  # an EOS: stop_reason None
            lps = [{t: Logprob(-rng.random() - 0.01, 1)} for t in ids]  # logprobs=0: the sampled token only
            outs.append(CompletionOutput(i, " ".join(map(str, ids)), ids, sum(next(iter(d.values())).logprob for d in lps),
                                         lps if sp.logprobs is not None else None, finish, stop))
        return outs


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in at ``vllm`` (and the submodules engine_vllm imports) for one test; environment the engine
    sets is undone after it."""
    LLM.instances = []
    mods = {}
    for name in ("vllm", "vllm.inputs", "vllm.lora", "vllm.lora.request", "vllm.model_executor",
                 "vllm.model_executor.layers", "vllm.model_executor.layers.layernorm"):
        mods[name] = types.ModuleType(name)
        mods[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["vllm"].LLM, mods["vllm"].SamplingParams = LLM, SamplingParams
    mods["vllm.inputs"].TokensPrompt = lambda **kw: dict(kw)  # a TypedDict
    mods["vllm.lora.request"].LoRARequest = LoRARequest
    mods["vllm.model_executor.layers.layernorm"].RMSNorm = RMSNorm
    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(name, "")  # recorded, so that what the engine sets is undone after the test
        monkeypatch.delenv(name)
    return mods["vllm"]
