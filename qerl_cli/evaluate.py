"""Stage `qerl eval`: score a model (+ LoRA adapter) on a local math benchmark, pass@1 / pass@k.

How it works: the dataset (GSM8K ``question``/``answer ... #### N``, MATH-500 ``problem``/
``answer``, or plain ``prompt``/``answer``; JSONL or Parquet) is read by ``qerl_cli.data`` -- the
same loader, prompt template and chat template rollouts use -- and generated with the same
engine (native, or vLLM with ``--engine vllm``). The model is loaded with the adapter applied
by ``qerl_cli.models.load_model``, whose loader refuses an adapter that does not change the
logits on a probe, and the number of wrapped LoRA modules is written into metrics.json: the
reference code's eval silently dropped the adapter and reported the base model's score.

Scoring reuses ``qerl_cli.answers.is_correct`` (the training reward's own rule), so "correct"
in eval and in training can never disagree. ``--scorer auto`` picks per problem: a numeric
reference (GSM8K) uses the final-number rule (``####``, ``\\boxed{}`` or ``<answer>``, numbers
compared as exact fractions), anything else (MATH: ``\\frac{\\sqrt3}{2}``, intervals) uses
math-verify's symbolic equivalence on the last ``\\boxed{}`` (else the last ``<answer>`` tag).

Greedy decoding (temperature 0) gives pass@1 by default. ``--k K`` samples ``--num-samples N``
(default K) completions per problem at ``--temperature`` and reports pass@1..pass@K with the
unbiased estimator (``qerl_cli.eval_metrics``). Everything the score depends on (model and
adapter hashes, dataset hash, template, sampling, seed, the device's kind and dtype) goes into the manifest
fingerprint, so rerunning the same eval is "already done" and two runs can be compared with ``--compare``; a finished
eval made on another device is this eval's too (``eval_devices.made_elsewhere``), a stopped one resumes only on its
kind of device (``cuda`` or ``cuda:1``, alike) and GPU model (``eval_devices.check_made_on_this_gpu``), and its partial
directory elsewhere is removed once --out holds the eval finished (``eval_devices``). The answer
rules' versions (``answers.RULE_VERSION``, and for the math rule math-verify's and sympy's: ``rule_packages``) are
not in it but in metrics.json: a rerun under other rules scores the finished samples.jsonl again, generating
nothing, rather than report the old rules' score.

The output is a resumable ``StageOutput``, as rollout's: samples.jsonl grows in a partial directory
named by the fingerprint, a problem's samples appended together and flushed. A rerun after an
interrupt keeps the problems whose samples are all there (a prefix in dataset order), regenerates
from the chunk of the first missing one (each problem seeded by its own index, so the same samples)
and writes the samples.jsonl and metrics.json of an uninterrupted run; one that kept every problem loads no model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from qerl_cli.answers import RULE_VERSION, rule_packages
from qerl_cli.engine.sampling_params import MIN_TEMPERATURE
from qerl_cli.errors import (
    NONFINITE_LOGITS_HINT,
    BadInputError,
    NumericalError,
    OtherGpuModelError,
    OutputExistsError,
    QerlWarning,
)
from qerl_cli.eval_devices import (
    MADE_ON,
    adopt_indexed_partial,
    check_made_on_this_gpu,
    made_elsewhere,
    record_made_on,
    sweep_other_devices_partials,
)
from qerl_cli.eval_metrics import METRICS, SAMPLES, k_values, length_stats, rules_used, score_block
from qerl_cli.hashing import model_hash, sha256_file, text_files_hash
from qerl_cli.math_rule import long_math_reference
from qerl_cli.outputs import (
    StageOutput,
    WriterLock,
    crash_point,
    forget_completed,
    sweep_leftover_partial,
)
from qerl_cli.runtime import as_many, check_field_types, device_kind
from qerl_cli.stops import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    blank_stop,
    every_stopped,
    stop_takes_tag,
    think_stop,
)

STAGE = "eval"
DEFAULT_MAX_NEW_TOKENS = 1024
SCORERS = ("auto", "gsm8k", "math")
ENGINES = ("native", "vllm")


@dataclass
class EvalConfig:
    model: Path
    dataset: Path
    out: Path
    adapter: Path | None = None
    k: int = 1
    num_samples: int | None = None  # default: k
    temperature: float | None = None  # default: 0 (greedy) for k = 1, else 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None  # default: DEFAULT_MAX_NEW_TOKENS, or half the model's context if less
    stop: tuple[str, ...] = ()  # stop strings (EOS always stops)
    prompt_template: str | None = None  # same default as rollout: the row's prompt as it is
    system_prompt: str | None = None
    chat_template: bool | None = None  # None: use it when the tokenizer has one
    chat_template_file: Path | None = None  # a Jinja chat template replacing the tokenizer's (or giving it one)
    chat_template_kwargs: dict | str | None = None  # extra chat template variables: a dict, or its JSON text
    scorer: str = "auto"
    prompt_key: str | None = None  # the dataset's own column names, as rollout's flags
    answer_key: str | None = None
    max_problems: int | None = None
    engine: str = "native"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_num_seqs: int = 64
    max_model_len: int | None = None
    allow_base_mismatch: bool = False
    force: bool = False
    progress: bool = True

    # The defaults of num_samples and temperature are resolved on read, not written into the fields, so
    # dataclasses.replace(cfg, k=1) from a k = 4 config gets one greedy sample again, not 4 at 1.0.
    @property
    def samples(self) -> int:
        """Samples per problem: --num-samples, or k."""
        return self.k if self.num_samples is None else self.num_samples

    @property
    def sampling_temperature(self) -> float:
        """--temperature, or 0 (greedy) for one sample per problem and 1.0 for several."""
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.samples == 1 else 1.0

    def __post_init__(self):
        check_field_types(self)
        self.model, self.dataset, self.out = Path(self.model), Path(self.dataset), Path(self.out)
        self.adapter = Path(self.adapter) if self.adapter is not None else None
        self.stop = as_many(self.stop)
        if isinstance(self.prompt_template, os.PathLike):  # "a string or a file": a Path names the file
            self.prompt_template = str(self.prompt_template)
        if self.k < 1:
            raise BadInputError(f"--k must be at least 1, got {self.k}")
        if self.samples < self.k:
            raise BadInputError(f"--num-samples {self.samples} is less than --k {self.k}",
                                hint="pass@k needs at least k samples per problem")
        t = self.sampling_temperature
        if not (math.isfinite(t) and t >= 0):
            raise BadInputError(f"--temperature must be a finite number >= 0, got {t}")
        if 0 < t < MIN_TEMPERATURE:
            raise BadInputError(f"--temperature {t:g} is below {MIN_TEMPERATURE:g}, which vLLM treats as greedy",
                                hint="pass --temperature 0 for greedy decoding")
        if self.engine == "vllm":
            from qerl_cli.engine_vllm import check_vllm_device, check_vllm_temperature

            check_vllm_temperature(t)
            check_vllm_device(self.device)
        if t == 0 and self.samples > 1:
            raise BadInputError(f"--temperature 0 (greedy) with {self.samples} samples per problem gives "
                                "identical samples", hint="pass --temperature > 0 for pass@k")
        if not 0 < self.top_p <= 1:
            raise BadInputError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise BadInputError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.chat_template_file is not None and self.chat_template is False:
            raise BadInputError("--chat-template-file with --no-chat-template: the file would not be used")
        from qerl_cli.data import parse_chat_template_kwargs

        self.chat_template_kwargs = parse_chat_template_kwargs(self.chat_template_kwargs)
        if self.chat_template_kwargs and self.chat_template is False:
            raise BadInputError("--chat-template-kwargs with --no-chat-template: no template would read them")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise BadInputError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        self.stop = tuple(self.stop)
        if any(not x for x in self.stop):
            raise BadInputError("--stop strings must be non-empty")
        if self.scorer not in SCORERS:
            raise BadInputError(f"--scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        if self.engine not in ENGINES:
            raise BadInputError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.max_problems is not None and self.max_problems < 1:
            raise BadInputError(f"--max-problems must be at least 1, got {self.max_problems}")
        if self.max_num_seqs < 1:
            raise BadInputError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.engine == "native" and self.samples > self.max_num_seqs:
            raise BadInputError(f"--num-samples {self.samples} exceeds --max-num-seqs {self.max_num_seqs}: a problem's "
                                "samples decode together", hint=f"pass --max-num-seqs {self.samples} or more")
        from qerl_cli.data import template_file
        from qerl_cli.outputs import check_out_apart

        # --force deletes the old output: never one holding a template this eval reads (a rerun could not be made)
        check_out_apart(self.out, model=self.model, adapter=self.adapter, dataset=self.dataset,
                        chat_template_file=self.chat_template_file, prompt_template=template_file(self.prompt_template))


# ---- scoring -----------------------------------------------------------------------------------
def scorer_for(reference: str, scorer: str = "auto") -> str:
    """The answer kind a problem is scored with: a reference the gsm8k rule reads as a number (the
    training reward's own rule: "72", "+5", "7 apples", "$1,000", "... #### 72") -> gsm8k; anything
    in LaTeX or not a number -> math (math-verify)."""
    if scorer != "auto":
        return scorer
    from qerl_cli.answers import reference_answer

    ref = str(reference)
    return "gsm8k" if "\\" not in ref and reference_answer(ref, "gsm8k") is not None else "math"


@dataclass
class Scored:
    extracted: str | None
    correct: bool
    kind: str


def score_completion(completion: str, reference: str, scorer: str = "auto", opens_think: bool = False) -> Scored:
    """Extract the completion's answer and judge it against ``reference`` with the rollout rewards' rule;
    ``opens_think``: its prompt ended inside a ``<think>`` it opened (judged as rollout judges it)."""
    from qerl_cli.answers import extract_answer, is_correct
    from qerl_cli.stops import judged_completion

    completion = judged_completion(completion, opens_think)
    kind = scorer_for(reference, scorer)
    extracted = extract_answer(completion, kind)
    return Scored(extracted, extracted is not None and is_correct(completion, reference, kind), kind)


# ---- generation --------------------------------------------------------------------------------
@dataclass
class Sample:
    """One generated completion, engine-independent."""

    token_ids: list[int]
    text: str
    finish_reason: str
    finite: bool = True  # every sampled token's log-prob finite: False means NaN/Inf logits




# generate(prompt_token_ids, n, seeds, progress) -> per prompt, n samples, each prompt seeded by its seed in
# ``seeds``; progress(prompts_done, tokens) is called as prompts finish (engines that cannot report it never do)
GenerateFn = Callable[..., list[list[Sample]]]


def _sampling_kwargs(cfg: EvalConfig, tokenizer) -> dict:  # seeded per problem through the engines' ``seeds``
    from qerl_cli.runtime import split_stops

    stops, stop_ids = split_stops(tokenizer, cfg.stop)
    return dict(temperature=cfg.sampling_temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, stop=stops,
                stop_token_ids=stop_ids, seed=0)


def native_generator(cfg: EvalConfig, tokenizer, device: str, torch_dtype, max_model_len: int):
    """(generate, info) over the native engine; the model carries the adapter when one is given."""
    from qerl_cli.aqn import clear_noise
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.layers.lora import lora_modules
    from qerl_cli.models import load_model

    t0 = time.time()
    model = load_model(cfg.model, device=device, dtype=torch_dtype, adapter_dir=cfg.adapter)
    clear_noise(model)  # eval measures the clean policy: no AQN noise
    n_lora = len(list(lora_modules(model)))
    if cfg.adapter is not None and n_lora == 0:
        raise BadInputError(f"--adapter {cfg.adapter}: no LoRA module was attached to the model")
    if cfg.adapter is not None:  # the Linears the adapter fills, as a resume counts them: not those PEFT leaves out
        from qerl_cli.adapters import adapter_module_count  # (layers_to_transform), whose LoRA stays at zero

        n_lora = adapter_module_count(cfg.adapter)
    t1 = time.time()
    engine = LLMEngine(model, tokenizer, max_num_seqs=cfg.max_num_seqs, max_model_len=max_model_len)
    timings = {"load_s": round(t1 - t0, 3), "engine_s": round(time.time() - t1, 3)}

    sampling = _sampling_kwargs(cfg, tokenizer)  # once: it reads the tokenizer's special tokens

    def generate(prompt_ids, n, seeds, progress=None):
        sp = SamplingParams(**sampling)
        groups = engine.generate(prompt_ids, sp, n=n, progress=progress, seeds=seeds)
        return [[Sample(list(c.token_ids), c.text, c.finish_reason, all(map(math.isfinite, c.logprobs))) for c in g]
                for g in groups]

    return generate, {"engine": "native", "lora_modules": n_lora, "timings": timings}


def vllm_generator(cfg: EvalConfig, tokenizer, dtype_name: str, max_model_len: int):
    """(generate, info) over the rollout stage's vLLM engine, with the adapter as a LoRA request."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise BadInputError("--engine vllm needs vLLM, which is not installed", hint="pip install 'qerl[vllm]'")
    from qerl_cli.engine_vllm import VLLMEngine, vllm_sampling_params

    engine = VLLMEngine(cfg.model, adapter_dir=cfg.adapter, dtype=dtype_name, max_num_seqs=cfg.max_num_seqs,
                        max_model_len=max_model_len, seed=cfg.seed, ship_functions=False)

    sampling = _sampling_kwargs(cfg, tokenizer)  # once: it reads the tokenizer's special tokens

    def generate(prompt_ids, n, seeds, progress=None):
        sp = vllm_sampling_params(top_k=0, min_p=0.0, **sampling)
        groups = engine.generate(prompt_ids, sp, n=n, progress=progress, seeds=seeds)
        return [[Sample(list(c.token_ids), c.text, c.finish_reason) for c in g] for g in groups]

    return generate, {"engine": "vllm", "lora_modules": None}


# ---- the stage ---------------------------------------------------------------------------------
def _fingerprint_config(cfg: EvalConfig, device: str, dtype: str, template: str | None, every_row: bool = False) -> dict:
    d = asdict(cfg)
    if every_row:  # --max-problems at or above the dataset's rows scores them all, as leaving it out does
        d["max_problems"] = None
    d["prompt_template"] = template  # the text, also when the flag named a file
    d.update(num_samples=cfg.samples, temperature=cfg.sampling_temperature)  # resolved, as outputs always recorded them
    for key in ("model", "dataset", "out", "adapter", "force", "progress", "allow_base_mismatch", "chat_template_file"):
        d.pop(key)  # (the chat template file's text is an input: inputs["chat_template"])
    d.pop("max_num_seqs")  # the batching changes no sample: every problem is seeded by itself
    for key in ("prompt_key", "answer_key", "chat_template_kwargs"):  # unset, as outputs made before the flags recorded nothing
        if d[key] is None:
            d.pop(key)
    # Nor does the context: every prompt must fit beside --max-new-tokens (else the eval stops), so no
    # sample reaches it. Counted, an explicit value equal to the model's own made a needless new run.
    d.pop("max_model_len")
    d.update(device=device, dtype=dtype, stop=list(cfg.stop))  # as JSON holds it: a rerun's manifest says [] too
    return d


def _legacy_fingerprint_config(config: dict, cfg: EvalConfig, default_was: int | None = None) -> tuple[dict, ...]:
    """Fingerprints of outputs that older qerl finished, which still read as done: it counted
    --max-model-len (until session 39), and seeded each batch, so a sampled eval counted --max-num-seqs
    (until 2026-11-26). ``default_was``: the fixed default --max-new-tokens of older qerl, where this run
    took the default and that one fit the context too (its outputs were made with it)."""
    olds = [dict(config, max_model_len=cfg.max_model_len)]
    if cfg.sampling_temperature != 0:
        olds.append(dict(olds[0], max_num_seqs=cfg.max_num_seqs))
    if config["max_problems"] != cfg.max_problems:  # recorded as typed until 2026-11-27 (50 vs 60 of 5 rows: exit 4)
        olds += [dict(o, max_problems=cfg.max_problems) for o in (config, *olds)]
    if default_was is not None:
        olds += [dict(o, max_new_tokens=default_was) for o in olds] + [dict(config, max_new_tokens=default_was)]
    return tuple(olds)


DEFAULT_CHANGED = "2026-11-26T21:13:40Z"  # commit 8ecb69e: the default became half the context where that is less


def _created_before(out: Path, when: str) -> bool:
    """Whether ``out`` holds an output whose manifest was written before ``when`` (ISO UTC, as manifests say)."""
    try:
        created = json.loads((Path(out) / "manifest.json").read_text()).get("created")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(created, str) and created < when


def default_max_new_tokens(context: int) -> int:
    """--max-new-tokens when not given: DEFAULT_MAX_NEW_TOKENS, or half the model's context (rounded up)
    where that is less, so the default leaves prompts room on a small model (1024 was refused outright on
    the bundled model's 255-token context). On a model of 2048+ positions it is 1024, as before."""
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, (context + 1) // 2))  # 2047 (2048 positions less one): 1024


def _rescored_because(metrics: dict) -> str | None:
    """Why a finished eval's verdicts may not be today's, or None. The rules it scored with only ("scored_with":
    {"gsm8k": 200}), and under --scorer auto the gsm8k rule that chose them (rules_used): a new math rule leaves a
    gsm8k eval as it is. An eval the math rule scored is scored again under other versions of math-verify,
    latex2sympy2_extended or sympy too (``scorer_packages``): the verdicts are theirs, and "already done" is to print
    the score today's qerl gives these samples, the one a new eval beside it in --compare is scored by; scoring again
    generates nothing (milliseconds a verdict), where keeping the old verdicts left --force, which generates all again.
    None recorded (an eval made before the field): unknown versions, scored again once, as one without
    ``scorer_version``."""
    used = rules_used(metrics)
    old = metrics.get("scorer_version") or {}
    if any(old.get(kind) != RULE_VERSION.get(kind) for kind in used):
        return "older answer rules"
    if "math" in used and metrics.get("scorer_packages") != rule_packages():
        return "other versions of math-verify, latex2sympy2_extended or sympy"
    return None


def _rescores(cfg: EvalConfig, manifest: dict, metrics: dict) -> bool:
    """Whether a finished run of these arguments is scored again: its verdicts may not be today's
    (``_rescored_because``), so "already done" would print the old rule's score. Its samples.jsonl
    holds every completion, so it is resumed as a run that kept every problem: no model, no generation, and its
    output is replaced whole, as any finished run's (a stop midway leaves the old one)."""
    why = _rescored_because(metrics)
    if why is None:
        return False
    if manifest["config"].get("max_new_tokens") != cfg.max_new_tokens:  # older qerl's default (``default_was``)
        if cfg.progress:  # its samples scored again, the new manifest would say they were generated with today's
            print(f"note: {cfg.out} was scored by {why} and generated with an older default "
                  "--max-new-tokens: its score is the old rules'; pass --force to redo it", file=sys.stderr)
        return False
    if cfg.progress:
        print(f"note: {cfg.out} was scored by {why}: scoring its samples again with today's "
              "(generating only those whose prompts qerl now renders otherwise)", file=sys.stderr)
    return True


def _problem_seed(seed: int, index: int) -> int:
    """The sampling seed of problem ``index`` (its row in the dataset): reproducible, whatever the batch."""
    return (seed * 1_000_003 + index) % (2**31 - 1)


def evaluate(cfg: EvalConfig, *, generate: GenerateFn | None = None, console=None) -> dict:
    """Run `qerl eval`; returns ``{"out", "already_done", "metrics", "manifest"}``.

    ``generate`` replaces the engine (tests); by default the native or vLLM engine is built.
    """
    from qerl_cli.data import (
        load_prompts,
        load_template,
        no_answer,
        read_chat_template,
    )
    from qerl_cli.lineage import check_lineage
    from qerl_cli.runtime import context_limit, gpu_model, resolve_device, resolve_dtype

    t_start = time.time()
    if not cfg.model.is_dir():
        raise BadInputError(f"--model {cfg.model}: not a directory")
    if cfg.adapter is not None and not cfg.adapter.is_dir():
        raise BadInputError(f"--adapter {cfg.adapter}: not a directory")
    if not cfg.dataset.exists():
        raise BadInputError(f"--dataset {cfg.dataset} does not exist")
    template = load_template(cfg.prompt_template)
    try:
        rows = load_prompts(cfg.dataset, flag="--dataset", prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                            columns=False)  # its scorers read the reference only
    except BadInputError as e:
        # Not a hint offering --skip-bad-lines, which eval does not have (every problem counts); any
        # other hint (pip install 'qerl[parquet]') stays.
        hint = "eval scores every row: fix or remove it" if "--skip-bad-lines" in (e.hint or "") else e.hint
        msg = e.args[0] if e.args[0].startswith("--dataset") else f"--dataset: {e.args[0]}"  # not "--dataset: --dataset x"
        raise BadInputError(msg, hint=hint) from None
    every_row = cfg.max_problems is None or cfg.max_problems >= len(rows)
    if cfg.max_problems:
        rows = rows[: cfg.max_problems]
    missing = next((r for r in rows if r.answer is None), None)
    if missing is not None:
        lacks, key_hint = no_answer(cfg.dataset, missing, cfg.answer_key)
        raise BadInputError(f"{missing.where}: row {lacks}; eval needs a reference per problem", hint=key_hint)
    long = long_math_reference([r for r in rows if scorer_for(r.answer, cfg.scorer) == "math"], "sample")
    if long is not None:  # a reference the math rule cannot read: said before generating
        warnings.warn(QerlWarning(long), stacklevel=2)

    default_was = None  # older qerl's fixed default, where this run takes the default and that one fit
    if cfg.max_new_tokens is None:  # resolved before the fingerprint, which records the number generated with
        context = context_limit(cfg.model, cfg.max_model_len)[0]
        cfg = replace(cfg, max_new_tokens=default_max_new_tokens(context))
        if (context > DEFAULT_MAX_NEW_TOKENS and cfg.max_new_tokens != DEFAULT_MAX_NEW_TOKENS
                and _created_before(cfg.out, DEFAULT_CHANGED)):  # not today's explicit --max-new-tokens 1024
            default_was = DEFAULT_MAX_NEW_TOKENS
    device = resolve_device(cfg.device)
    dtype_name, torch_dtype = resolve_dtype(cfg.dtype, device)
    base_hash = model_hash(cfg.model)
    inputs = {"model": base_hash, "dataset": sha256_file(cfg.dataset)}
    lineage = None
    if cfg.adapter is not None:
        from qerl_cli.adapters import adapter_inputs

        lineage = check_lineage(cfg.adapter, cfg.model, base_hash, hint="evaluate it on the model it was trained on",
                                allow_mismatch=cfg.allow_base_mismatch)
        inputs.update(adapter_inputs(cfg.adapter))
    # The device's kind, as rollout's: which GPU of the node runs it changes no number, and a stop on cuda:1 keeps one
    # partial directory and writer lock that --device cuda resumes (its GPU model checked there: check_made_on_this_gpu)
    config = _fingerprint_config(cfg, device_kind(device), dtype_name, template, every_row)
    elsewhere = made_elsewhere(cfg, config, STAGE)
    if elsewhere is not None:  # found done (or scored again) as made there; nothing is generated here (engine())
        here = config["device"], config["dtype"]
        config.update(device=elsewhere[0], dtype=elsewhere[1])
        if (device_kind(elsewhere[0]), elsewhere[1]) == here:  # an older qerl's on cuda:1 (its fingerprint named the
            elsewhere = None  # GPU's index until 2026-11-28): these numerics, its fingerprint kept
    legacy_inputs = dict(inputs)  # qerl before 2026-11-26 did not count the tokenizer files
    # the prompts' tokens (chat template) and where sampling stops; not the named chat templates
    # (additional_chat_templates/), which eval never renders
    inputs["text"] = text_files_hash(cfg.model, named_templates=False)
    chat_text = None
    if cfg.chat_template_file is not None:
        chat_text, inputs["chat_template"] = read_chat_template(cfg.chat_template_file)
    so = StageOutput(cfg.out, STAGE, config=config, inputs=inputs, force=cfg.force, resumable=True, started=t_start,
                     legacy_configs=_legacy_fingerprint_config(config, cfg, default_was), legacy_inputs=(legacy_inputs,))
    done = None  # the metrics of a finished run of these arguments that today's answer rules score again
    if so.already_done(check_first=lambda: _encode(cfg, rows, template, chat_text, notes=False)):
        sweep_leftover_partial(so)
        sweep_other_devices_partials(so)
        done = json.loads((cfg.out / METRICS).read_text())
        # said even with --quiet: `--device cpu` printed a GPU's bf16 score unsaid (a review); not between a node's GPUs
        # (made with --device cuda:1, rerun with auto: "not cuda (bf16)" advised --force, all generated again for nothing)
        if elsewhere is not None:  # the device as given there (cuda:1), which metrics.json records
            print(f"note: {cfg.out} was generated on {done.get('device', elsewhere[0])} ({elsewhere[1]}), not {device} "
                  f"({dtype_name}): its score is that device's (pass --force to generate it here)", file=sys.stderr)
        else:
            _say_made_on_another_gpu_model(cfg.out, done, device)
        if not _rescores(cfg, so.manifest, done):
            return {"out": str(cfg.out), "already_done": True, "metrics": done, "manifest": so.manifest}
        # found done, now redone: a stop midway must not say "a rerun says already done"; so.out, as found done (a
        # symlinked --out is its target there)
        forget_completed(so.out)
    tokenizer, prompts, max_model_len = _encode(cfg, rows, template, chat_text)
    if done is None:  # samples to generate (a finished eval scored again keeps the ones it has)
        _check_stops_leave_the_scorers_their_tags(cfg, prompts)

    info: dict = {"engine": cfg.engine, "lora_modules": None}

    def engine() -> GenerateFn:
        """The generate function, its model loaded only here: a resume (or a rescoring) that kept every problem
        has nothing to generate, and loading a 32B model for it took minutes."""
        nonlocal generate, info
        if elsewhere is not None:  # scored again, an older rendering of its prompts must be generated anew
            shutil.rmtree(so.work, ignore_errors=True)  # a copy of the finished samples, which stay whole at --out
            raise OutputExistsError(f"{cfg.out} was generated on {elsewhere[0]} ({elsewhere[1]}): scoring it again, some "
                                    "of its problems must be generated again (qerl now renders their prompts "
                                    f"otherwise), which {device} ({dtype_name}) would do with other numerics",
                                    hint=f"rerun this eval on {elsewhere[0]}, or pass --force to generate it all here")
        made_gpu = done.get("gpu") if done is not None else None  # a resume's is checked: check_made_on_this_gpu
        if isinstance(made_gpu, str) and gpu is not None and made_gpu != gpu:  # so too a rescoring's, where recorded
            shutil.rmtree(so.work, ignore_errors=True)
            raise OtherGpuModelError(f"{cfg.out} was generated on {made_gpu!r}: scoring it again, some of its problems "
                                    "must be generated again (qerl now renders their prompts otherwise), which this "
                                    f"{gpu!r} would do with other numerics",
                                    hint="rerun this eval on a GPU of that model, or pass --force to generate it all here")
        if generate is None:
            if cfg.engine == "vllm":
                generate, info = vllm_generator(cfg, tokenizer, dtype_name, max_model_len)
            else:
                generate, info = native_generator(cfg, tokenizer, device, torch_dtype, max_model_len)
        return generate

    so.timings["prepare_s"] = round(time.time() - t_start, 3)  # checks, input hashes, tokenizer, encoding
    records = None  # every record, once generated
    # The writer lock before the model loads: a second run of this eval (a requeued Slurm job) is refused
    # at once (exit 8), not after loading a 32B model.
    with WriterLock(so):
        gpu = gpu_model(device)  # None on a CPU, asked of CUDA only here: a run writing a partial directory on a GPU
        if done is None:  # a stopped run's problems to resume (a rescoring copies the finished ones over them)
            adopt_indexed_partial(so, device, gpu)
            check_made_on_this_gpu(so, gpu)
        try:
            with so as work:
                record_made_on(work, cfg.dtype, config, gpu)
                if done is not None:  # the finished run's samples, kept as a stopped run's are: scored, none generated
                    shutil.copyfile(cfg.out / SAMPLES, work / SAMPLES)
                records, t_gen, n_tokens, resumed = _generate_and_score(cfg, prompts, engine, work, console)
                if generate is None and cfg.engine == "native":  # no model loaded: what native_generator counts
                    from qerl_cli.adapters import adapter_module_count

                    info["lora_modules"] = adapter_module_count(cfg.adapter) if cfg.adapter is not None else 0
                # where its samples were generated: here (cuda:1 as given; the fingerprint holds its kind), or the
                # finished eval's device that this one scored again
                made = device if done is None else done.get("device", config["device"])
                metrics = _metrics(cfg, records, template, base_hash, inputs, lineage, info, made, config["dtype"],
                                   gpu if done is None else done.get("gpu"))
                metrics["time"] = {
                    "total_s": round(time.time() - t_start, 3),
                    "generate_s": round(t_gen, 3),
                    # this run's tokens only: the resumed problems' were generated (and timed) by another run
                    "tokens_per_s": round(n_tokens / t_gen, 1) if t_gen > 0 else None,
                }
                if done is not None:
                    if resumed["problems"] == len(prompts):  # the time of the run that generated them, not this scoring's
                        # (a samples.jsonl whose prompts today's qerl renders otherwise is generated again: this run's)
                        metrics["time"] = done.get("time", metrics["time"])
                    so.extra["rescored_from"] = {k: done.get(k) for k in ("scorer_version", "scorer_packages")}
                (work / METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
                (work / MADE_ON).unlink(missing_ok=True)  # the partial directory's, not the output's
                so.extra["summary"] = {k: metrics[k] for k in ("score_name", "score", "ci95", "counts")}
                so.extra["resumed"] = resumed
                so.timings.update(info.pop("timings", {}), generate_s=round(t_gen, 3))
        except OutputExistsError:
            raise  # another run's output at --out (the final swap's check): the finished problems stay for a rerun
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt) and records is not None:  # stopped after the last problem was saved
                e.kept_problems = (len(prompts), len(prompts), so.work)  # (its stop line said "before generating")
            so.drop_work_if_nothing_kept(SAMPLES)  # stopped before its first problem: nothing left, as before eval resumed
            raise
    sweep_other_devices_partials(so)
    return {"out": str(cfg.out), "already_done": False, "metrics": metrics, "manifest": so.manifest}


def _say_made_on_another_gpu_model(out: Path, done: dict, device: str) -> None:
    """A note where the finished eval found done at ``out`` was generated on another GPU model than ``device``'s: its
    score is that model's numerics (the model is not in the fingerprint: a finished eval is the eval's on any GPU, as
    on a CPU node, which gets its own note). An A100 node's rerun printed an H100's score unsaid (grpo.sh's rerun, a
    Slurm job requeued; a review, session 59). CUDA is asked only where metrics.json records a model (none on a CPU)."""
    from qerl_cli.runtime import gpu_model

    made = done.get("gpu")
    if not isinstance(made, str):
        return
    here = gpu_model(device)
    if here is not None and here != made:
        print(f"note: {out} was generated on {made!r}, not this {here!r}: its score is that GPU model's numerics (pass "
              "--force to generate it here)", file=sys.stderr)


def _check_stops_leave_the_scorers_their_tags(cfg: EvalConfig, prompts) -> None:
    """A stop string is cut from the text scored, as in rollout (`rollout_checks.check_stops_leave_the_think_closed`,
    the same `think_stop`). Every scorer reads nothing after a `<think>` left open, so one that takes `</think>` out of it
    (`--stop '</think>'`) scored 0 every problem whose prompt opens one (R1's and QwQ's chat templates), silently:
    refused; where none does, a sample that opens its own is left inside it: warned of, as one that takes the opening
    `<think>` (`--stop '<think>'`), which cuts such a sample before its answer (both missed until 2026-11-28). One
    that takes the opening `<answer>` (`'\\n<answer'`) cuts a sample that answers inside the tag before its answer,
    box and `####` line too: warned of whatever the scorer (`--scorer math` was told nothing until a review); one that
    takes only `</answer>` leaves the rules no closed tag to read: warned of whatever the scorer (the math rule reads
    the tag where no box answers since math 2; until then `--scorer math` was not warned), naming the rules that
    score some problem (the gsm8k rule's `####` lines were said to score where every reference is LaTeX, until
    2026-11-28). A stop made only of whitespace (`$'\\n\\n'`) where a prompt opens `<think>` cuts a sample inside
    its thought: warned of (`blank_stop`, as in rollout)."""
    found = think_stop(cfg.stop, prompts)
    if found is not None:
        x, tag, prompt = found
        what = f"--stop {x!r} is cut from the completion text scored"
        if tag == THINK_OPEN:
            warnings.warn(QerlWarning(f"{what}, so a sample that opens its own {THINK_OPEN} (its prompt opens none: "
                                      f"{prompt.row.where}) is cut there, before its answer: it scores 0"), stacklevel=3)
        elif prompt is not None:
            raise BadInputError(f"{what}, so that text never holds {THINK_CLOSE}, and the prompt opens a <think> "
                                f"({prompt.row.where}): the answer rules read nothing after one left open, so "
                                f"{every_stopped(x, tag, 'sample')} scores 0",
                                hint="drop that --stop (EOS and --max-new-tokens still end samples)")
        else:
            warnings.warn(QerlWarning(f"{what}, so that text never holds {THINK_CLOSE}, and the answer rules read "
                                      "nothing after a <think> left open: a sample it stops that opened its own <think> "
                                      "scores 0"), stacklevel=3)
    blank = blank_stop(cfg.stop, prompts)
    if blank is not None:
        warnings.warn(QerlWarning(f"--stop {blank[0]!r} is only whitespace and the prompt opens a <think> "
                                  f"({blank[1].row.where}): a sample is cut at the first {blank[0]!r} of its "
                                  "thought, the <think> left open, where the answer rules read nothing: it scores 0"),
                      stacklevel=3)
    for x in cfg.stop:
        if stop_takes_tag(x, ANSWER_OPEN):
            warnings.warn(QerlWarning(f"--stop {x!r} is cut from the completion text scored, so a sample that answers "
                                      "inside an <answer> tag is cut before its answer: it scores 0 (an answer outside "
                                      "the tag still scores)"), stacklevel=3)
        elif stop_takes_tag(x, ANSWER_CLOSE):  # named: the rules that score some problem (`scorer_for`)
            kinds = sorted({scorer_for(p.row.answer, cfg.scorer) for p in prompts})
            rules = f"the {' and '.join(kinds)} {'rules read' if len(kinds) > 1 else 'rule reads'}"
            kept = "#### lines and \\boxed{} still score" if "gsm8k" in kinds else "\\boxed{} still scores"
            warnings.warn(QerlWarning(f"--stop {x!r} is cut from the completion text scored: {rules} no <answer> "
                                      f"tag's answer from a sample it stops ({kept})"), stacklevel=3)


def _encode(cfg: EvalConfig, rows, template, chat_text, notes: bool = True):
    """The tokenizer and every problem encoded, with every check of the flags that need them (chat
    template, stops, context): (tokenizer, prompts, max_model_len)."""
    from qerl_cli.data import EncodeReport, encode_prompts, set_chat_template
    from qerl_cli.models.config import ModelConfig
    from qerl_cli.runtime import context_limit, load_tokenizer, split_stops

    tokenizer = load_tokenizer(cfg.model)
    if chat_text is not None:
        set_chat_template(tokenizer, chat_text, cfg.chat_template_file)
    split_stops(tokenizer, cfg.stop)  # a stop that could never match is refused before any work
    max_model_len, raise_hint = context_limit(cfg.model, cfg.max_model_len)  # the engine caps it so too
    if cfg.max_model_len is not None and cfg.max_model_len > max_model_len and notes and cfg.progress:
        print(f"note: --max-model-len {cfg.max_model_len} is beyond the model's limit; {raise_hint}", file=sys.stderr)
    room = max_model_len - cfg.max_new_tokens
    if room < 1:
        raise BadInputError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for the prompt in a "
                            f"{max_model_len}-token context", hint=f"lower --max-new-tokens; {raise_hint}")
    # Every problem counts: a prompt that does not fit is an error, never silently dropped from the score.
    enc_report = EncodeReport()
    prompts = encode_prompts(rows, tokenizer, template=template, system_prompt=cfg.system_prompt,
                             chat_template=cfg.chat_template, chat_template_kwargs=cfg.chat_template_kwargs,
                             max_prompt_tokens=room, on_long="error",
                             long_hint=f"shorten the prompt, or lower --max-new-tokens: prompts of up to {max_model_len - 1} "
                                       f"tokens fit with --max-new-tokens 1; {raise_hint}", report=enc_report,
                             vocab_size=ModelConfig.from_dir(cfg.model).vocab_size)
    if enc_report.own_system and notes and cfg.progress:
        print(f"note: {len(enc_report.own_system)} problems have their own system message, which --system-prompt "
              f"does not replace (first: {enc_report.own_system[0]})", file=sys.stderr)
    return tokenizer, prompts, max_model_len


RECORD_KEYS = ("id", "sample", "prompt", "completion", "extracted", "reference", "correct", "scorer", "finish_reason",
               "num_tokens")


def _kept_samples(path: Path, prompts, n: int, scorer: str) -> tuple[list[dict], int]:
    """The records of the problems a stopped run of these arguments finished, and how many lines after them
    were dropped. Kept: a prefix in dataset order, problem i's ``n`` samples in order; a torn last line, a
    problem with fewer than ``n`` samples, or a line that is not this run's next sample ends it. The file
    is cut to the kept lines, so appending continues on a whole line. Kept samples are scored again: a
    stopped run of an older qerl (another answer rule, which the fingerprint does not count) would
    otherwise mix two rules' verdicts in one score."""
    tmp = path.with_name(path.name + ".rescored")
    tmp.unlink(missing_ok=True)  # a run stopped while rewriting left it: not part of the output
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    kept: list[dict] = []
    group: list[dict] = []
    end = pos = 0
    for line in data.split(b"\n")[:-1]:  # the piece after the last newline is torn (or empty)
        i = len(kept) // n
        rec = _sample_of(line, prompts[i], len(group)) if i < len(prompts) else None
        if rec is None:
            break
        group.append(rec)
        pos += len(line) + 1
        if len(group) == n:
            kept += group
            group, end = [], pos
    tail = data[end:]
    rescored = [_rescored(r, prompts[i // n], scorer) for i, r in enumerate(kept)]
    if rescored != kept:  # every kept line written again, with today's verdicts
        # beside it, then renamed over it: written in place, a kill or a full disk mid-write lost every kept problem
        with open(tmp, "wb") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rescored).encode("utf-8"))
            os.fsync(f.fileno())
        os.replace(tmp, path)
    elif tail:
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return rescored, tail.count(b"\n") + (not tail.endswith(b"\n") if tail else 0)


def _rescored(rec: dict, p, scorer: str) -> dict:
    sc = score_completion(rec["completion"], p.row.answer, scorer, p.opens_think)
    return {**rec, "extracted": sc.extracted, "correct": sc.correct, "scorer": sc.kind}


def _sample_of(line: bytes, p, j: int) -> dict | None:
    """``line`` as sample ``j`` of problem ``p``, or None where it is not that (torn, foreign, another problem's)."""
    try:
        rec = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(rec, dict) or tuple(rec) != RECORD_KEYS:
        return None
    if rec["id"] != p.row.id or rec["sample"] != j or rec["prompt"] != p.text or rec["reference"] != p.row.answer:
        return None
    return rec


def _generate_and_score(cfg: EvalConfig, prompts, engine: Callable[[], GenerateFn], work: Path,
                        console) -> tuple[list[dict], float, int, dict]:
    """Generate and score every problem not already in ``work``'s samples.jsonl, appending each problem's
    samples as it is scored; returns (every record in dataset order, generation seconds, tokens this run
    generated, {"problems": resumed, "dropped_lines": cut from the partial file}). ``engine()`` gives the
    generate function, asked for only where a problem is left to generate."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    n = cfg.samples
    # Chunks of several engine batches: the engine's continuous batching keeps its slots full
    # within a chunk (only the chunk's tail runs partly empty), while samples.jsonl and the
    # progress line still advance chunk by chunk on engines that report no per-prompt progress.
    chunk = max(1, 4 * cfg.max_num_seqs // n)
    records, dropped = _kept_samples(work / SAMPLES, prompts, n, cfg.scorer)
    kept = len(records) // n
    # A resume starts at the chunk of the first missing problem and generates that chunk whole: the same
    # prompts batched together as in an uninterrupted run, so the same bits (batched matmuls round alike).
    first = kept - kept % chunk if kept < len(prompts) else len(prompts)
    generate = engine() if first < len(prompts) else None
    t_gen = 0.0
    solved = sum(any(r["correct"] for r in records[i * n : (i + 1) * n]) for i in range(kept))
    tokens = 0  # generated by this run (a resumed chunk's kept problems included: they were generated again)
    t_start = time.time()
    progress = Progress(TextColumn("[bold]eval[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console or Console(stderr=True),
                        disable=not cfg.progress, transient=False)

    def info(extra_tokens: int = 0) -> str:
        rate = (tokens + extra_tokens) / max(time.time() - t_start, 1e-9)
        return f"{rate:,.0f} tok/s" + (f" · solved {solved}" if records else "")

    try:
        with progress, open(work / SAMPLES, "a", encoding="utf-8") as out:
            task = progress.add_task("eval", total=len(prompts), completed=kept, info="")
            for start in range(first, len(prompts), chunk):
                batch = prompts[start : start + chunk]

                def on_progress(done: int, generated: int, start=start) -> None:
                    progress.update(task, completed=max(kept, start + done), info=info(generated))

                t0 = time.time()
                seeds = [_problem_seed(cfg.seed, start + i) for i in range(len(batch))]
                groups = generate([p.token_ids for p in batch], n, seeds, on_progress)
                t_gen += time.time() - t0
                if len(groups) != len(batch) or any(len(g) != n for g in groups):
                    raise RuntimeError(f"engine returned {[len(g) for g in groups]} samples for {len(batch)} prompts x {n}")
                for index, (p, group) in enumerate(zip(batch, groups), start):
                    tokens += sum(len(s.token_ids) for s in group)
                    if index < kept:
                        continue  # kept from the stopped run; generated again only because its chunk had a missing problem
                    recs = [_scored(cfg, p, j, s) for j, s in enumerate(group)]
                    # A problem's samples in one write, flushed: a stop keeps whole problems (a kill may still
                    # tear the write, which the resume cuts off).
                    out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
                    out.flush()
                    records += recs
                    solved += any(r["correct"] for r in recs)
                    crash_point("eval-problem")
                os.fsync(out.fileno())  # once a chunk: what a machine crash may lose
                progress.update(task, completed=start + len(batch), info=info())
    except KeyboardInterrupt as e:
        e.kept_problems = (len(records) // n, len(prompts), work)  # for the stop line: what a rerun resumes
        raise
    return records, t_gen, tokens, {"problems": kept, "dropped_lines": dropped}


def _scored(cfg: EvalConfig, p, j: int, s: Sample) -> dict:
    """Sample ``j`` of problem ``p`` as its samples.jsonl record (keys: RECORD_KEYS)."""
    if not s.finite:  # a score of NaN-logit samples would look like a real, bad model
        raise NumericalError(f"{p.row.where}: sample {j} was drawn from NaN/Inf logits; --out was not written (the "
                             "problems finished before it are kept for a rerun)", hint=NONFINITE_LOGITS_HINT)
    sc = score_completion(s.text, p.row.answer, cfg.scorer, p.opens_think)
    return dict(zip(RECORD_KEYS, (p.row.id, j, p.text, s.text, sc.extracted, p.row.answer, sc.correct, sc.kind,
                                  s.finish_reason, len(s.token_ids))))


def _metrics(cfg, records: Sequence[dict], template, base_hash, inputs, lineage, info, device, dtype_name,
             gpu: str | None = None) -> dict:
    """metrics.json; ``gpu``: the model of the GPU that generated the samples (``runtime.gpu_model``; None on a CPU)."""
    n = cfg.samples
    per_problem: dict[str, list[dict]] = {}
    for r in records:
        per_problem.setdefault(r["id"], []).append(r)
    counts_nc = [(len(v), sum(x["correct"] for x in v)) for v in per_problem.values()]
    ks = k_values(cfg.k)
    scores = score_block(counts_nc, ks)
    head = f"pass@{cfg.k}"
    kinds: dict[str, int] = {}
    for v in per_problem.values():
        kinds[v[0]["scorer"]] = kinds.get(v[0]["scorer"], 0) + 1
    return {
        "schema_version": 1,
        "model": str(cfg.model),
        "model_hash": base_hash,
        "adapter": str(cfg.adapter) if cfg.adapter else None,
        "adapter_hash": inputs.get("adapter"),
        "lineage": lineage,
        "lora_modules": info.get("lora_modules"),
        "dataset": str(cfg.dataset),
        "dataset_hash": inputs["dataset"],
        "score_name": head,
        "score": scores[head]["value"],
        "ci95": scores[head]["ci95"],
        "scores": scores,
        "scorer": cfg.scorer,
        "scored_with": kinds,
        "scorer_version": dict(RULE_VERSION),  # a rerun under other rules scores the samples again (_rescores)
        "scorer_packages": rule_packages(),  # the math rule's verdicts are theirs: a rerun under others, too
        "counts": {
            "problems": len(per_problem),
            "samples_per_problem": n,
            "samples": len(records),
            "correct_samples": sum(c for _, c in counts_nc),
            "problems_solved": sum(1 for _, c in counts_nc if c > 0),
            "no_answer": sum(1 for r in records if r["extracted"] is None),
            "truncated": sum(1 for r in records if r["finish_reason"] == "length"),
        },
        "lengths": length_stats([r["num_tokens"] for r in records]),
        "sampling": {"temperature": cfg.sampling_temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
                     "stop": list(cfg.stop), "seed": cfg.seed},
        "prompt_template": template,
        "engine": info.get("engine", cfg.engine),
        "device": device,
        "dtype": dtype_name,
        # not in the fingerprint (a finished eval is the eval's on any GPU), but what --compare names: two GPU models'
        # kernels round otherwise, and "cuda" alone did not tell an A100's eval from an H100's
        "gpu": gpu,
    }


def result_line(metrics: dict, out, already_done: bool = False) -> str:
    """One line for ``-q``: every score with its 95% CI, the problem count and the output directory
    (``in OUT`` for an already-done rerun, which wrote nothing)."""
    scores = ", ".join(f"{name} {100 * s['value']:.2f}% (95% CI {100 * s['ci95'][0]:.1f}-{100 * s['ci95'][1]:.1f})"
                       for name, s in metrics["scores"].items())
    return f"{scores} on {metrics['counts']['problems']} problems; {'in' if already_done else 'wrote'} {out}"


def render_metrics(metrics: dict, console) -> None:
    """The end-of-run table: scores with CI, counts, lengths, time."""
    from rich.markup import escape
    from rich.table import Table

    c = metrics["counts"]
    t = Table(title=f"qerl eval: {Path(metrics['dataset']).name}", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right", overflow="fold")  # a long adapter path whole, not cut with "…"
    # escaped: a cell is Rich markup, where a path's "[x]" was dropped and "a[/b]" a MarkupError after the eval was written
    t.add_row("model", escape(metrics["model"] + (f" + {metrics['adapter']}" if metrics.get("adapter") else "")))
    for name, s in metrics["scores"].items():
        lo, hi = s["ci95"]
        t.add_row(name, f"{100 * s['value']:.2f}%  (95% CI {100 * lo:.1f}-{100 * hi:.1f})")
    t.add_row("problems / samples", f"{c['problems']} / {c['samples']}")
    t.add_row("solved", f"{c['problems_solved']}")
    t.add_row("no answer / truncated", f"{c['no_answer']} / {c['truncated']}")
    L = metrics["lengths"]
    t.add_row("completion tokens mean / p90 / max", f"{L['mean']:.0f} / {L['p90']} / {L['max']}")
    tm = metrics["time"]
    t.add_row("time", f"{tm['total_s']:.1f}s in all" if not tm.get("tokens_per_s") else
              f"{tm['total_s']:.1f}s in all; generating {tm['generate_s']:.1f}s = {tm['tokens_per_s']} tok/s")
    console.print(t)
