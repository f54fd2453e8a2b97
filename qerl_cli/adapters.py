"""PEFT-format LoRA adapters: save from / load into a qerl model.

Keys and config are PEFT's own (``base_model.model.<module>.lora_A.weight`` [r, in],
``lora_B.weight`` [out, r], ``adapter_config.json`` with ``peft.LoraConfig``'s keys), so an adapter
saved here loads with ``peft.PeftModel.from_pretrained`` on the dequantized base and in vLLM, and
an adapter trained with PEFT loads here. The config is written without importing peft: that import
(peft, transformers and what they pull in) took 5.5 s of a train step on a CPU and ~7 s on an H100
machine, only to write one JSON file (docs/benchmarks.md, "RL loop"); tests load it with peft and
compare it with the ``LoraConfig`` peft itself builds from the same settings. Loading is strict:
every tensor must land on a wrapped Linear with the right shape, every Linear PEFT wraps must get its
pair (one PEFT leaves out, e.g. by ``layers_to_transform``, keeps B = 0), and an adapter with nonzero B that
nevertheless leaves the logits unchanged on a probe input is an error (the failure mode of silently
applying nothing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from qerl_cli.checkpoint.safetensors_io import save_small
from qerl_cli.errors import BadInputError
from qerl_cli.hashing import dir_hash
from qerl_cli.layers.lora import LoraSpec, lora_disabled, lora_modules

PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# An adapter_config.json without lora_alpha means PEFT's LoraConfig default, whatever r is.
PEFT_DEFAULT_ALPHA = 8
NORMS = "norms.safetensors"  # train-step --train-norms: trained RMSNorm weights (fp32), beside the PEFT files


@dataclass(frozen=True)
class AdapterInfo:
    r: int
    alpha: float
    targets: tuple[str, ...]
    hash: str


# PEFT LoRA variants whose saved tensors are not "add scale * B @ A to the base as it is": applying them
# as plain LoRA gives another model without any error, so every reader refuses them.
# (PEFT lists LoRA-GA among them too: its init subtracts scale * B0 @ A0 from the base weight)
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")  # the adapter is relative to a rewritten base


# PEFT LoRA features with tensors or arithmetic beyond A and B: without this list they were refused
# later, as a "trained tensor ... is not in --model", which reads like a wrong base.
# layer_replication: the adapter's layer i is a copy of some other base layer (PEFT rebuilds the stack), so its
# keys do not name the base's layers: merge applied them to the wrong layers of the unexpanded model.
_UNSUPPORTED_FEATURES = ("trainable_token_indices", "use_qalora", "use_bdlora", "kasa_config", "velora_config",
                         "monteclora_config", "arrow_config", "layer_replication")


def unsupported_lora_variant(cfg: dict) -> str | None:
    """Why a PEFT LoRA config cannot be applied as plain LoRA (None when it can)."""
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        return (f"init_lora_weights={init!r}: the adapter is relative to a base PEFT rewrote at initialisation "
                "(save it converted to plain LoRA with path_initial_model_for_weight_conversion)")
    if cfg.get("lora_bias"):
        return "lora_bias=true (a trained bias on lora_B) is not supported"
    for key in _UNSUPPORTED_FEATURES:  # PEFT writes each as null/false/empty when unused
        if cfg.get(key):
            return f"{key} is set: this PEFT feature is not plain LoRA, which is all qerl applies"
    if cfg.get("alora_invocation_tokens"):
        return "alora_invocation_tokens is set: activated LoRA applies only after its invocation tokens, which qerl does not do"
    return None


def check_config_types(cfg, path) -> None:
    """The adapter_config.json values every reader computes with, as PEFT writes them: one line naming the
    file and key for a hand-edited or foreign config (a list, ``"lora_alpha": null``, ``"r": "8"`` or a
    rank_pattern key that is no regex crashed with a traceback, or said "rank 8 but r=8")."""
    if not isinstance(cfg, dict):
        raise BadInputError(f"{path}: expected a JSON object, got {type(cfg).__name__}")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if "r" in cfg and not (isinstance(cfg["r"], int) and not isinstance(cfg["r"], bool) and cfg["r"] > 0):
        raise BadInputError(f"{path}: 'r' must be a positive integer, got {cfg['r']!r}")
    if "lora_alpha" in cfg and not number(cfg["lora_alpha"]):
        raise BadInputError(f"{path}: 'lora_alpha' must be a number, got {cfg['lora_alpha']!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(key)
        if not pattern:
            continue
        if not isinstance(pattern, dict):
            raise BadInputError(f"{path}: {key} must map module-name patterns to values, got {pattern!r}")
        for k, v in pattern.items():
            try:
                re.compile(k)
            except re.error as e:
                raise BadInputError(f"{path}: {key} key {k!r} is not a valid regex ({e})") from None
            if not number(v) or (key == "rank_pattern" and not (isinstance(v, int) and v > 0)):
                raise BadInputError(f"{path}: {key}[{k!r}] must be a {'positive integer' if key == 'rank_pattern' else 'number'}, got {v!r}")
    _check_module_matchers(cfg, path)


def _check_module_matchers(cfg: dict, path) -> None:
    """The fields ``peft_leaves_out`` matches module names with, of the types PEFT writes (a string among them is a
    regex): a TypeError or re.error traceback otherwise."""
    def regex(key, v):
        try:
            re.compile(v)
        except re.error as e:
            raise BadInputError(f"{path}: {key} {v!r} is not a valid regex ({e})") from None

    def strings(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    for key in ("target_modules", "exclude_modules", "layers_pattern", "modules_to_save"):
        v = cfg.get(key)
        if v is None:
            continue
        if key != "modules_to_save" and isinstance(v, str):
            regex(key, v)
        elif not strings(v):
            raise BadInputError(f"{path}: {key} must be a list of module names"
                                + (" or a regex" if key != "modules_to_save" else "") + f", got {v!r}")
        elif key in ("layers_pattern", "modules_to_save"):  # PEFT puts each list entry into a regex too
            for x in v:
                regex(key, x)
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)) and not (
            isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        raise BadInputError(f"{path}: layers_to_transform must be a layer index or a list of them, got {layers!r}")
    # PEFT's LoraConfig refuses this pair (its regex alone picks the modules: check_target_module_exists never reads
    # the layers then), so the adapter loads nowhere in PEFT; peft_leaves_out would apply every pair the regex
    # matches, the layers dropped without a word (rollout, eval and vLLM refused any layers_to_transform until
    # 2026-11-28; train-step then continued it into an adapter on every layer)
    if isinstance(cfg.get("target_modules"), str) and _uses_layer_indexes(cfg):
        raise BadInputError(f"{path}: layers_to_transform {layers!r} with a regex target_modules "
                            f"{cfg['target_modules']!r}: PEFT refuses this config (the regex alone picks the modules)",
                            hint="name the layers in the regex, or list the target names in target_modules")


def _uses_layer_indexes(cfg: dict) -> bool:
    """PEFT's test for ``layers_to_transform`` being in force: any int (0 too: it was read as unset) or a non-empty list."""
    layers = cfg.get("layers_to_transform")
    return layers is not None and layers != []


def _layer_index(cfg: dict, module: str) -> int | None:
    """The layer index PEFT reads from a module name: the first numbered path part (after a ``layers_pattern`` part)."""
    patterns = cfg.get("layers_pattern")
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            if m := re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module):
                break
    return int(m["idx"]) if m else None


def _names_suffix(names, module: str) -> bool:
    return module in names or any(module.endswith("." + n) for n in names)


TIED_HEAD = "lm_head"
ALL_LINEAR = "all-linear"  # PEFT's target_modules shorthand, matched in any case
_EMBEDDING_LAYER_NAMES = ("embed_tokens", TIED_HEAD)  # peft.utils.constants.EMBEDDING_LAYER_NAMES


def _all_linear_leaves_out(module: str) -> str | None:
    """Why PEFT's ``target_modules="all-linear"`` puts no LoRA on ``module``: it wraps every Linear but the model's
    output layer (peft _maybe_include_all_linear_layers). By name, as the decoders qerl reads name them: the output
    layer is lm_head, and embed_tokens is an Embedding, no Linear. Merge merged hand-added pairs of either, which PEFT
    drops without a word."""
    if module == TIED_HEAD:
        return f"target_modules {ALL_LINEAR!r} leaves out (PEFT's all-linear takes no output layer)"
    if module.rsplit(".", 1)[-1] == "embed_tokens":
        return f"target_modules {ALL_LINEAR!r} leaves out (an Embedding: PEFT's all-linear takes only Linears)"
    return None


def _ties_head(cfg: dict) -> bool:
    """PEFT's ensure_weight_tying puts LoRA on the head only where target_modules names an embedding layer (peft
    _check_tied_modules, EMBEDDING_LAYER_NAMES); beside "all-linear" or other targets it only warns, and a head pair in
    the file is dropped (merge merged it)."""
    if not cfg.get("ensure_weight_tying"):
        return False
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        return any(re.fullmatch(targets, n) for n in _EMBEDDING_LAYER_NAMES)
    return isinstance(targets, list) and any(isinstance(t, str) and t.rsplit(".", 1)[-1] in _EMBEDDING_LAYER_NAMES
                                             for t in targets)


def peft_leaves_out(cfg: dict, module: str) -> str | None:
    """Why PEFT puts no LoRA layer on ``module`` (a base module name, "model.layers.0.self_attn.q_proj"): the
    adapter_config.json field that says so, or None where PEFT wraps it (or only the model could tell: no
    target_modules; "all-linear" is read by the names of qerl's decoders, ``_all_linear_leaves_out``). PEFT loads an
    adapter file's tensors only into the LoRA layers it created and drops the rest without a word, so a reader that
    applies every pair in the file runs another policy than PEFT's. Mirrors
    peft.tuners.tuners_utils.check_target_module_exists (peft 0.17-0.21) and what PEFT wraps besides it."""
    # wrapped whatever exclude_modules and the layers say: the modules of target_parameters ("self_attn.q_proj.weight"
    # -> q_proj; PEFT saves their pairs under the module's name), and with ensure_weight_tying on a tied base the head,
    # which PEFT moves out of the saved target_modules (into the unsaved target_modules_to_tie) and saves its LoRA
    # (where target_modules names the embedding: _ties_head)
    params = cfg.get("target_parameters")
    if isinstance(params, list) and _names_suffix([p.rpartition(".")[0] for p in params if isinstance(p, str)], module):
        return None
    if module == TIED_HEAD and _ties_head(cfg):
        return None
    excluded = cfg.get("exclude_modules")
    if excluded and (re.fullmatch(excluded, module) if isinstance(excluded, str) else _names_suffix(excluded, module)):
        return f"exclude_modules {excluded!r} excludes"
    saved = cfg.get("modules_to_save")
    if saved and any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in saved):
        return f"modules_to_save {saved} trains in full (PEFT puts no LoRA on those)"
    targets = cfg.get("target_modules")
    if targets is None and params:
        return "target_modules (null: only target_parameters are adapted) does not name"
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return _all_linear_leaves_out(module)
    if isinstance(targets, str):
        return None if re.fullmatch(targets, module) else f"target_modules {targets!r} does not match"
    if not isinstance(targets, list):
        return None
    if module in targets:  # a full name: PEFT takes it in any layer
        return None
    if not _names_suffix(targets, module):
        return f"target_modules {targets} does not name"
    if not _uses_layer_indexes(cfg):
        return None
    layers, idx = cfg["layers_to_transform"], _layer_index(cfg, module)
    if idx is not None and (idx == layers if isinstance(layers, int) else idx in layers):
        return None
    pattern = f" (layers_pattern {cfg['layers_pattern']!r})" if cfg.get("layers_pattern") else ""
    return f"layers_to_transform {layers!r}{pattern} leaves out"


def check_peft_wraps(cfg: dict, modules, path, base_dir=None) -> None:
    """Refuse LoRA tensors of a module PEFT would not wrap (``peft_leaves_out``): every reader applies exactly the
    pairs PEFT applies (merge merged them, the loader and vLLM applied them: a hand-edited config, a review).
    ``base_dir``: the model the adapter is applied to, where the reader knows it, whose untied head takes no pair
    ensure_weight_tying lets through (``check_untied_head_pair``)."""
    for module in sorted(modules):
        if why := peft_leaves_out(cfg, module):
            raise BadInputError(f"{path}: LoRA tensors of {module!r}, which {why}: PEFT would not load them",
                                hint=f"correct {CONFIG}, or remove the module's tensors")
    if base_dir is not None:
        from qerl_cli.models.config import ModelConfig

        check_untied_head_pair(cfg, modules, path, ModelConfig.from_dir(Path(base_dir)).tie_word_embeddings, base_dir)


def check_untied_head_pair(cfg: dict, modules, path, tied: bool, base) -> None:
    """Refuse an lm_head pair that only ensure_weight_tying let through (``peft_leaves_out``: the head tied to a LoRA'd
    embedding) where the base ``base`` (``tied``: its tie_word_embeddings) has an untied head: PEFT then ties nothing
    (it warns "no tied modules were found"), puts no LoRA on a head target_modules does not name, and drops the pair.
    The one check of every reader that knows the base: merge merged such a pair (review s57r11), and rollout's and
    eval's vLLM engine handed it to vLLM, which applies the pairs in the file (the native engine refused it as "LoRA
    targets ['embed_tokens'] match no Linear")."""
    if tied or TIED_HEAD not in modules or not _ties_head(cfg):
        return
    if why := peft_leaves_out(dict(cfg, ensure_weight_tying=False), TIED_HEAD):
        raise BadInputError(f"{path}: LoRA tensors of {TIED_HEAD!r}, which {why}, and ensure_weight_tying ties nothing "
                            f"in --model {base} (its head is untied): PEFT would not load them",
                            hint=f"correct {CONFIG}, or remove the module's tensors")


def adapter_leaves_out(cfg: dict, modules) -> list[tuple[str, str]]:
    """(module, why) for each of ``modules`` (base module names) PEFT puts no LoRA on by the adapter's config
    (``read_adapter_config``; ``peft_leaves_out``): the loader keeps their LoRA at B = 0."""
    return [(m, why) for m in sorted(modules) if (why := peft_leaves_out(cfg, m))]


def model_not_adapter_hint(adapter_dir) -> str | None:
    """The hint for an --adapter without adapter_config.json that is a model directory (a merged or quantized
    model given where its adapter goes), else None."""
    if (Path(adapter_dir) / "config.json").is_file():
        return (f"{adapter_dir} holds config.json: it is a model, not a LoRA adapter; "
                "pass a merged model as --model, without --adapter")
    return None


def _read_config(adapter_dir: Path) -> dict:
    path = Path(adapter_dir) / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInputError(f"{path}: not found (is {adapter_dir} a PEFT adapter directory?)",
                            hint=model_not_adapter_hint(adapter_dir)) from None
    except ValueError as e:
        raise BadInputError(f"{path}: not valid JSON ({e})") from None
    check_config_types(cfg, path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise BadInputError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for key, ok in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) not in (ok, None):
            raise BadInputError(f"{path}: {key}={cfg.get(key)!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise BadInputError(f"{path}: per-module {key} is not supported")
    if cfg.get("modules_to_save"):
        raise BadInputError(f"{path}: modules_to_save is not supported")
    why = unsupported_lora_variant(cfg)
    if why:
        raise BadInputError(f"{path}: {why}")
    if "r" not in cfg:  # its type and sign: check_config_types
        raise BadInputError(f"{path}: missing 'r'")
    return cfg


def read_adapter_config(adapter_dir) -> dict:
    """The adapter's ``adapter_config.json``, checked as every reader checks it: a caller that needs it for more than
    ``read_adapter_spec`` reads it once and passes it on (both then see the same file)."""
    return _read_config(Path(adapter_dir))


def read_adapter_spec(adapter_dir, cfg: dict | None = None, base_dir=None) -> LoraSpec:
    """The LoraSpec an adapter directory was trained with (targets as module-name suffixes); ``cfg``: its
    ``read_adapter_config``, where the caller has it already; ``base_dir``: the model it is applied to
    (``check_peft_wraps``)."""
    cfg = _read_config(Path(adapter_dir)) if cfg is None else cfg
    # rollout's vLLM engine hands the file to vLLM, which applies every pair in it, and train-step resumes it
    # (a missing file is the reader's to report: the layout needs only the config)
    if (wpath := _weights_path(Path(adapter_dir))).exists():
        check_peft_wraps(cfg, _weight_modules(Path(adapter_dir)), wpath, base_dir)
    targets = cfg.get("target_modules")
    # PEFT allows a regex, and names matched as dotted suffixes ("self_attn.q_proj"): resolve both from
    # the saved keys (module names, which the loader wraps in every layer, at B = 0 where PEFT leaves one out); so
    # too a target that exclude_modules takes out of every layer (PEFT saves no pair of it: no LoRA on it at all)
    if isinstance(targets, str) or cfg.get("exclude_modules") or (
            isinstance(targets, list) and any(isinstance(t, str) and "." in t for t in targets)):
        targets = _targets_from_weights(Path(adapter_dir))
    if not targets or not all(isinstance(t, str) for t in targets):
        raise BadInputError(f"{Path(adapter_dir) / CONFIG}: target_modules must name the adapted modules, got {targets!r}")
    return LoraSpec(r=cfg["r"], alpha=float(cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)), dropout=float(cfg.get("lora_dropout") or 0.0),
                    targets=tuple(sorted(targets)), use_rslora=bool(cfg.get("use_rslora", False)))


def _open_weights(path: Path):
    """``safe_open`` with a one-line BadInputError for a truncated or corrupt file."""
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise BadInputError(f"{path}: not found") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for truncated/corrupt files
        raise BadInputError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _weights_path(adapter_dir: Path) -> Path:
    """The adapter's safetensors weights; a PEFT adapter saved with ``safe_serialization=False`` has only
    ``adapter_model.bin`` (a pickle, never loaded here): say so rather than a bare "not found"."""
    path = Path(adapter_dir) / WEIGHTS
    if not path.exists() and (Path(adapter_dir) / "adapter_model.bin").exists():
        raise BadInputError(f"{path}: not found; {adapter_dir} holds adapter_model.bin, a pickle, which qerl does not load",
                            hint="re-save the adapter with PEFT's save_pretrained(..., safe_serialization=True)")
    return path


def require_weights(adapter_dir) -> Path:
    """The adapter's weights file, or the one-line "not found" error: train-step checks it before the lineage check,
    which called a half-copied adapter (its config without its weights) another adapter than the rollout's."""
    path = _weights_path(Path(adapter_dir))
    if not path.is_file():
        raise BadInputError(f"{path}: not found ({adapter_dir} holds {CONFIG} but not its LoRA weights)",
                            hint="copy the adapter directory whole, or rerun the train-step that wrote it")
    return path


def _weight_modules(adapter_dir: Path) -> set[str]:
    """The base module names the adapter file holds LoRA tensors of."""
    with _open_weights(_weights_path(adapter_dir)) as fh:
        return {k.removeprefix(PREFIX).split(".lora_")[0] for k in fh.keys() if ".lora_" in k}


def _targets_from_weights(adapter_dir: Path) -> set[str]:
    return {m.rsplit(".", 1)[-1] for m in _weight_modules(adapter_dir)}


def lora_config(*, r: int, alpha: float, dropout: float, targets: list[str], rslora: bool,
                base_model_path: str) -> dict:
    """``adapter_config.json`` of a plain LoRA: the keys ``peft.LoraConfig`` writes for these settings
    whose values are not its defaults, plus the ones every reader checks (vLLM reads r, lora_alpha,
    target_modules, bias, use_rslora and use_dora). peft fills the rest with its defaults on load."""
    return {"base_model_name_or_path": base_model_path, "bias": "none", "fan_in_fan_out": False,
            # float(): an int alpha from the Python API wrote `8`, the CLI `8.0`: two hashes for one adapter
            "inference_mode": False, "init_lora_weights": True, "lora_alpha": float(alpha), "lora_dropout": float(dropout),
            "modules_to_save": None, "peft_type": "LORA", "r": r, "target_modules": sorted(targets),
            "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": rslora}


def save_adapter(model, out_dir, *, base_model_path, extra_config: dict | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (fp32) for every LoRALinear."""
    mods = list(lora_modules(model))
    if not mods:
        raise ValueError("model has no LoRA modules to save")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = mods[0][1]
    targets = {n.rsplit(".", 1)[-1] for n, _ in mods}
    rslora = abs(first.scaling - first.alpha / first.r) > 1e-12
    config = lora_config(r=first.r, alpha=first.alpha, dropout=float(getattr(first.dropout, "p", 0.0)),
                         targets=list(targets), rslora=rslora, base_model_path=str(base_model_path))
    config.update(extra_config or {})
    # Sorted keys and targets: the same adapter gets the same bytes (and adapter hash) in every process.
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    tensors = {}
    for name, m in mods:
        tensors[f"{PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().float().cpu().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().float().cpu().contiguous()
    save_small(tensors, out / WEIGHTS)
    return out


_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def adapter_module_count(adapter_dir) -> int:
    """How many LoRA modules ``load_adapter`` fills from this adapter, from its tensor names alone (no model): it
    requires an A and a B for every module it wraps, and a wrapped module for every tensor."""
    with _open_weights(_weights_path(Path(adapter_dir))) as fh:
        return len({m["mod"] for k in fh.keys() if (m := _KEY.match(k.removeprefix(PREFIX)))})


def load_adapter(model, adapter_dir, *, probe: bool = True) -> AdapterInfo:
    """Copy a PEFT adapter into the model's LoRALinears (they must exist: ``load_model(lora=...)``)."""
    adapter_dir = Path(adapter_dir)
    cfg = _read_config(adapter_dir)
    wpath = _weights_path(adapter_dir)
    if not wpath.exists():
        raise BadInputError(f"{wpath}: not found")
    mods = dict(lora_modules(model))
    if not mods:
        raise BadInputError(f"{adapter_dir}: the model has no LoRA modules to load the adapter into")
    seen: dict[str, set] = {n: set() for n in mods}
    values = {}
    with _open_weights(wpath) as fh:
        check_peft_wraps(cfg, {m["mod"] for k in fh.keys() if (m := _KEY.match(k.removeprefix(PREFIX)))}, wpath,
                         getattr(model, "model_dir", None))  # (a model built in memory has none)
        for key in fh.keys():
            m = _KEY.match(key[len(PREFIX):] if key.startswith(PREFIX) else key)
            if m is None:
                raise BadInputError(f"{wpath}: tensor {key!r} is not a LoRA A/B weight")
            name, ab = m["mod"], m["ab"]
            if name not in mods:
                raise BadInputError(f"{wpath}: tensor {key!r} targets {name!r}, which is not a LoRA module of this model "
                                    f"(targets here: {sorted({n.rsplit('.', 1)[-1] for n in mods})})")
            lin = mods[name]
            want = lin.lora_A if ab == "A" else lin.lora_B
            t = fh.get_tensor(key)
            if tuple(t.shape) != tuple(want.shape):
                raise BadInputError(f"{wpath}: tensor {key!r} has shape {tuple(t.shape)}, the model expects "
                                    f"{tuple(want.shape)} (rank r={lin.r})")
            if not torch.isfinite(t).all():
                raise BadInputError(f"{wpath}: tensor {key!r} contains NaN or Inf")
            values[(name, ab)] = t
            seen[name].add(ab)
    # PEFT puts no LoRA layer on a module its config leaves out (layers_to_transform, exclude_modules, a target_modules
    # regex: peft_leaves_out) and saves no pair of it; here a target the adapter adapts is wrapped in every layer, so
    # such a module keeps B = 0 and its term adds exactly 0. A module PEFT wraps must have its pair (else the file is
    # damaged), and so must a target the adapter has no pair of at all (the layout given is not the adapter's).
    present = {n.rsplit(".", 1)[-1] for n, s in seen.items() if s}
    left_out = {n for n, s in seen.items() if not s and n.rsplit(".", 1)[-1] in present and peft_leaves_out(cfg, n)}
    incomplete = sorted((n for n, s in seen.items() if s != {"A", "B"} and n not in left_out),
                        key=lambda n: peft_leaves_out(cfg, n) is not None)  # one PEFT wraps named first
    if incomplete:
        raise BadInputError(f"{wpath}: no lora_A/lora_B for {incomplete[0]!r}"
                            + (f", a module {CONFIG} has PEFT wrap" if peft_leaves_out(cfg, incomplete[0]) is None else "")
                            + (f" (and {len(incomplete) - 1} more)" if len(incomplete) > 1 else ""))
    alpha = float(cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    scaling = alpha / (cfg["r"] ** 0.5) if cfg.get("use_rslora") else alpha / cfg["r"]
    with torch.no_grad():
        for (name, ab), t in values.items():
            (mods[name].lora_A if ab == "A" else mods[name].lora_B).copy_(t)
        for name in left_out:  # a model whose LoRA was trained or randomised before this load
            mods[name].lora_B.zero_()
        for lin in mods.values():
            lin.alpha, lin.scaling = alpha, scaling
    if probe and any(bool(mods[n].lora_B.abs().sum() > 0) for n in mods):
        _probe_changes_output(model, adapter_dir)
    targets = tuple(sorted({n.rsplit(".", 1)[-1] for n in mods}))
    return AdapterInfo(r=cfg["r"], alpha=alpha, targets=targets, hash=adapter_hash(adapter_dir))


def load_norms(model, path: Path) -> dict:
    """Copy an adapter's trained RMSNorm weights (``NORMS``) over the model's, by parameter name.
    Returns the base's weights it replaced, by name (train-step's KL reference is the base)."""
    import torch
    from safetensors import safe_open

    params = dict(model.named_parameters())
    replaced = {}
    with safe_open(str(path), framework="pt") as fh:
        for k in fh.keys():
            if k not in params:
                raise BadInputError(f"{path}: norm weight {k!r} matches no norm of this model")
            t = fh.get_tensor(k)
            if t.shape != params[k].shape:
                raise BadInputError(f"{path}: {k!r} has shape {tuple(t.shape)}, the model's is {tuple(params[k].shape)}")
            replaced[k] = params[k].detach().clone()
            with torch.no_grad():
                params[k].copy_(t.to(params[k].dtype))
    return replaced


def trained_norms(adapter_dir) -> Path | None:
    """The adapter's ``NORMS`` file (``train-step --train-norms``), or None where it has none."""
    path = Path(adapter_dir) / NORMS
    return path if path.exists() else None


def norms_input(adapter_dir) -> dict:
    """``{"adapter_norms": sha256}`` where the adapter has trained norms, else ``{}``: a stage applying the
    adapter records it beside the PEFT files' hash, so editing either makes it a different run."""
    from qerl_cli.hashing import sha256_file

    path = trained_norms(adapter_dir)
    return {"adapter_norms": sha256_file(path)} if path else {}


def adapter_inputs(adapter_dir) -> dict:
    """What a stage that applies the adapter records among its inputs: the PEFT files' hash and ``norms_input``."""
    return {"adapter": adapter_hash(adapter_dir), **norms_input(adapter_dir)}


def adapter_hash(adapter_dir) -> str:
    return dir_hash(Path(adapter_dir), names=[CONFIG, WEIGHTS])


def _probe_changes_output(model, adapter_dir) -> None:
    vocab = model.config.vocab_size
    ids = (torch.arange(8, device=model.device) * 7919 % vocab).unsqueeze(0)
    with torch.no_grad():
        with_lora = model.compute_logits(model.forward_train(ids))
        with lora_disabled(model):
            base = model.compute_logits(model.forward_train(ids))
    if torch.equal(with_lora, base):
        raise BadInputError(f"{adapter_dir}: adapter has nonzero lora_B but does not change the model's output "
                            "on a probe input (it would be a silent no-op)")
