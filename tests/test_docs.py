"""The docs against the code: every flag, script flag, config key and environment variable a page names exists,
and every stage command a page or a stage's --help shows parses and passes the stage's checks of its flags.

A new user copies commands from README.md and docs/*.md; a renamed flag left there fails only when someone runs
it. docs/benchmarks.md is left out: it keeps the commands of removed probes and reverted experiments on purpose
(its header says so).
"""

import importlib
import json
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
STAGES = ("quantize", "rollout", "train-step", "merge", "eval")
STAGE = r"\b(?:qerl|qerl_cli)\s+(" + "|".join(STAGES) + r")\b"
FLAG = r"(?<![\w-])--[a-z][a-z0-9-]*"


def code_lines(text: str):
    """Each line of a fenced block (backslash continuations joined) and each inline `code` span."""
    for block in re.findall(r"```.*?```", text, re.S):
        yield from block.replace("\\\n", " ").splitlines()
    yield from re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def command_texts(page: Path, start: str):
    """(name, the text after it, the line) for each command a code line of PAGE runs: START's group names it, up to
    the next command (or the ` -> ` of a chain of stages: `qerl quantize -> (rollout -> train-step)*`)."""
    for line in code_lines(page.read_text()):
        for m in re.finditer(start + r"(.*)", line):
            # a `|` inside brackets is a synopsis's choice (`[--format compressed-tensors|modelopt]`), not a pipe
            yield m.group(1), re.split(start + r"|[;#]|\|(?![^\[\]]*\])|&&|\s->\s", m.group(2))[0], line.strip()


def commands(page: Path, start: str):
    """(name, its flags, the line) for each command a code line of PAGE runs."""
    for name, rest, line in command_texts(page, start):
        yield name, re.findall(FLAG, rest), line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_stage_flag_a_page_names_exists(page):
    from typer.main import get_command

    from qerl_cli.cli import app

    flags = {name: {o for p in cmd.params for o in p.opts + p.secondary_opts} | {"--help"}
             for name, cmd in get_command(app).commands.items()}
    wrong = [f"qerl {stage} {flag}: {line}" for stage, found, line in commands(page, STAGE) for flag in found
             if flag not in flags[stage]]
    assert not wrong, "\n".join(wrong)


def shell_words(text: str) -> list[str]:
    """TEXT split into words as bash splits it, `$'...'` (a newline written \\n) included; nothing is expanded."""
    text = re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(m[1].encode().decode("unicode_escape")), text)
    return [w for w in shlex.split(re.sub(r"\\\s*$", "", text)) if w != "\\"]  # a continuation's backslash


def synopsis_words(text: str) -> list[str]:
    """The words of a page's command, its synopsis notation dropped: `[--adapter A]` given, `[--shards ...]` and
    `[options]` left out, a bare `...` (the rest of the command) too; of `[--device auto|cpu]`'s choices the first."""
    text = re.sub(r"\[[^\]]*(?:\.\.\.|options)[^\]]*\]", " ", text)
    text = re.sub(r"(?<=\S)\|[^\s\]]*(?=\])", "", text)
    text = re.sub(r"\[(?=-)|(?<=\S)\](?!\S)", " ", text)
    return shell_words(re.sub(r"(?<!\S)\.\.\.(?!\S)", " ", text))


# Flags naming what a stage reads, and what it writes: the check below points them at a directory that is not there.
INPUT_FLAGS = {"--model", "--adapter", "--prompts", "--dataset", "--shards", "--requantize-from", "--chat-template-file"}
OUTPUT_FLAGS = {"--out", "-o", "--metrics-file"}
REQUIRED = {"quantize": ["--out"], "rollout": ["--model", "--prompts", "--out"],
            "train-step": ["--model", "--shards", "--out"], "merge": ["--model", "--adapter", "--out"],
            "eval": ["--model", "--dataset", "--out"]}
# What a flag's own example is refused without (`--aqn-sigma-start needs --total-steps`).
NEEDS = {"--aqn-sigma-start": ["--aqn-sigma-end", "1e-4", "--total-steps", "100"], "--shard-index": ["--num-shards", "8"],
         "--requantize-from": ["--dtype", "nvfp4"]}


def _placeholder(param, value: str) -> bool:
    """`--step k`, `--num-shards N`: a page's stand-in for a number (the check gives the flag its default)."""
    default = param.default
    return (isinstance(default, (int, float)) and not isinstance(default, bool)
            and re.fullmatch(r"[A-Za-z]|[A-Z][A-Z0-9_]*", value) is not None)


def on_missing_inputs(stage: str, words: list[str], missing: Path, out: Path) -> list[str] | None:
    """`qerl STAGE WORDS` with every path it reads under MISSING (not there), every path it writes under OUT, each
    required flag the words leave out added, and a number's stand-in replaced by the flag's default; None where the
    words only name flags (`qerl eval --compare`, `qerl train-step --help`): no command to run."""
    from typer.main import get_command

    from qerl_cli.cli import app

    params = {o: p for p in get_command(app).commands[stage].params for o in p.opts + p.secondary_opts
              if o.startswith("-")}  # not quantize's `src`, eval's `runs`: a positional is a word like any other
    words = [part for w in words for part in (w.split("=", 1) if w.startswith("--") and "=" in w else [w])]
    if "--help" in words or all(w.startswith("-") for w in words):
        return None
    # The positionals the stage takes go under MISSING: quantize's source, eval's dirs (with --compare only). Any
    # other word stays as it is: `--force true` put `true` there too, and click's "unexpected extra argument
    # (.../not-there/true)" (eval's "unexpected argument ...") named MISSING as the input check does, and passed.
    positionals = 1 if stage == "quantize" else len(words) if stage == "eval" and "--compare" in words else 0
    args, i = [], 0
    while i < len(words):
        p = params.get(words[i])
        if p is None or p.is_flag or i + 1 == len(words):  # a switch, a positional, a stray word
            word = words[i]
            if not word.startswith("-") and positionals:
                word, positionals = str(missing / word.lstrip("/")), positionals - 1
            args.append(word)
            i += 1
            continue
        flag, value = words[i], words[i + 1]
        if flag in INPUT_FLAGS or flag in OUTPUT_FLAGS:
            value = str((missing if flag in INPUT_FLAGS else out) / value.lstrip("/"))
        elif _placeholder(p, value):
            value = str(p.default)
        args += [flag, value]
        i += 2
    if "--compare" not in args:
        for flag in REQUIRED[stage]:
            if not set(params[flag].opts) & set(args):
                args += [flag, str((out if flag in OUTPUT_FLAGS else missing) / "x")]
        if stage == "quantize" and not any(a.startswith(str(missing)) for a in args):
            args.insert(0, str(missing / "src"))
    return [stage, *args]


def assert_reaches_the_input_check(args: list[str], missing: Path, where: str) -> None:
    """The stage stops at the first path that is not there (exit 2, naming it): every flag's value parsed and passed
    the stage's own checks of flags, which come before its inputs are read."""
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    r = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERMINAL_WIDTH": ""})
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and lines and str(missing) in lines[-1], \
        f"{where}: qerl {shlex.join(args)}\n -> exit {r.exit_code}: {r.stderr.strip() or r.stdout[-500:]}"


class Reached(Exception):
    """Raised where a stage's work begins: every check of its flags, those against its inputs too, passed."""


# Where each stage's work begins (generation, the training loop, the tensors written), after every check of its flags
# against its inputs: replaced by a raise of Reached. (quantize checks nothing there but its source.)
WORK = {"quantize": "qerl_cli.quantize._run_pipeline", "rollout": "qerl_cli.rollout._run",
        "train-step": "qerl_cli.train_step._run", "merge": "qerl_cli.merge.merged_plan",
        "eval": "qerl_cli.evaluate.WriterLock"}


class StandIns(dict):
    """build_stand_ins's paths by input flag; and an adapter with the shards sampled with it for each LoRA layout
    a command names, trained when first asked for: a step continuing an adapter names the flags that trained it
    (recipes/lib.sh passes --lora-rank and --lora-alpha at every step, and the adapter must fit them)."""

    def __init__(self, paths: dict[str, str], root: Path):
        super().__init__(paths)
        self.root, self.adapters = root, {}

    def adapter(self, lora: dict[str, str]) -> tuple[str, str]:
        """(adapter dir, shards sampled with it) trained with LORA's --lora-rank, --lora-alpha, --lora-targets."""
        from qerl_cli.adapters import adapter_hash
        from tests.train_fixtures import base_hash_of, make_shard, quick_step

        key = tuple(sorted(lora.items()))
        if key not in self.adapters:
            d = self.root / f"adapter-{len(self.adapters)}"
            quick_step(Path(self["--model"]), Path(self["--shards"]), d / "adapter",
                       lora_rank=int(lora.get("--lora-rank", 16)), lora_alpha=float(lora.get("--lora-alpha", 16)),
                       lora_targets=tuple(lora["--lora-targets"].split(",")) if "--lora-targets" in lora else None)
            shards = make_shard(d / "shards", base_hash_of(Path(self["--model"])), adapter_hash=adapter_hash(d / "adapter"),
                                step=1)
            self.adapters[key] = (str(d / "adapter"), str(shards))
        return self.adapters[key]


def build_stand_ins(root: Path) -> StandIns:
    """What a page's command reads, built from the bundled tiny model under ROOT, by the input flag that names it
    (`src`: quantize's source): the model and its NVFP4 QDIR, shards sampled from it, prompts, a chat template
    (and, on demand, adapters: StandIns). The model is given a 7B's context (the pages' --max-new-tokens
    2048 fit) and a chat template that reads `enable_thinking`, as Qwen3's does (the pages' --chat-template-kwargs)."""
    import shutil

    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.helpers import THINKING_CHAT_TEMPLATE
    from tests.train_fixtures import base_hash_of, make_shard

    src = Path(shutil.copytree(ROOT / "qerl_cli" / "assets" / "tiny_model", root / "src"))
    for name, more in (("config.json", {"max_position_embeddings": 32768}),
                       ("tokenizer_config.json", {"model_max_length": 32768, "chat_template": THINKING_CHAT_TEMPLATE})):
        (src / name).write_text(json.dumps(dict(json.loads((src / name).read_text()), **more)))
    q = root / "q"
    quantize(QuantizeConfig(src=src, out=q, device="cpu", progress=False))
    rows = [{"prompt": f"Q: {a} + 1?\nA:", "input": f"Q: {a} + 1?\nA:", "answer": str(a + 1),
             "reward_model": {"ground_truth": str(a + 1)}} for a in range(64)]  # --prompts-per-step 64
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "chat.jinja").write_text(THINKING_CHAT_TEMPLATE)
    return StandIns({"src": str(src), "--model": str(q), "--prompts": str(root / "prompts.jsonl"),
                     "--dataset": str(root / "prompts.jsonl"), "--shards": str(make_shard(root / "shards", base_hash_of(q))),
                     "--requantize-from": str(src), "--chat-template-file": str(root / "chat.jinja")}, root=root)


def on_stand_ins(args: list[str], missing: Path, stand_ins: StandIns) -> list[str]:
    """ARGS (on_missing_inputs's) with each path under MISSING a stand-in of what its flag names (the repository's
    file where the page names one), and a GPU's --device cpu: the input check took its value, and CI has no GPU."""
    args = list(args)
    for i, arg in enumerate(args):
        if arg.startswith(str(missing)) and (ROOT / arg[len(str(missing)) + 1:]).exists():
            args[i] = str(ROOT / arg[len(str(missing)) + 1:])  # the repository's own: qerl_cli/assets/tiny_model
        elif arg.startswith(str(missing)):
            flag = args[i - 1] if args[i - 1] in INPUT_FLAGS else "src"
            if flag == "--adapter" or flag == "--shards" and "--adapter" in args:  # the adapter's, of its layout
                lora = {f: args[j + 1] for j, f in enumerate(args[:-1]) if f.startswith("--lora-")}
                args[i] = stand_ins.adapter(lora)[flag == "--shards"]
            else:
                args[i] = stand_ins[flag]
        elif args[i - 1] == "--device" and arg.startswith("cuda"):
            args[i] = "cpu"
    return args


def assert_reaches_the_work(args: list[str], missing: Path, stand_ins: StandIns, where: str) -> None:
    """The stage, given stand-ins of its inputs, passes every check of its flags, those that need its inputs too
    (--max-new-tokens against the model's context, --reward's names, --keep-activations against its layers), and
    reaches its work: a stale flag the input check stops before is found here."""
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    def reached(*_, **__):
        raise Reached

    if "--compare" in args:  # tabulates finished evals: no work, nor a check beyond the input check's
        return
    args = on_stand_ins(args, missing, stand_ins)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WORK[args[0]], reached)
        if "vllm" in args:  # `--engine vllm`: rollout asks for the package before its work
            from tests import vllm_standin

            vllm_standin.install(mp)
        r = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERMINAL_WIDTH": ""})
    assert isinstance(r.exception, Reached), \
        f"{where}: qerl {shlex.join(args)}\n -> exit {r.exit_code}: {r.stderr.strip() or r.stdout[-500:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_stage_command_a_page_shows_parses_and_passes_the_flag_checks(page, tmp_path, doc_stand_ins):
    # A renamed choice (`--scale-rewards batch`), a flag that became a switch or a value that stopped parsing was
    # found only by a user pasting the page. Each command, its inputs pointed at a directory that is not there,
    # must stop at that directory: its flags' checks come first. Then, its inputs stand-ins built from a tiny
    # model, it must reach its work: the checks that need the inputs (--reward's names, --max-new-tokens against
    # the model's context) were not reached by the first, and a stale flag beyond them passed.
    missing, out = tmp_path / "not-there", tmp_path / "out"
    for stage, rest, line in command_texts(page, STAGE):
        args = on_missing_inputs(stage, synopsis_words(rest), missing, out)
        if args is not None:
            assert_reaches_the_input_check(args, missing, f"{page.name}: {line}")
            assert_reaches_the_work(args, missing, doc_stand_ins, f"{page.name}: {line}")


@pytest.mark.parametrize("stage, command", [
    ("merge", "--model Q --adapter A --out M --force true"),  # a switch given a value
    ("train-step", "--model Q --shards S --out A --deterministic yes"),  # a config's TRAIN_EXTRA
    ("eval", "--model M --dataset D --out E -q 1"),
    ("rollout", "--model Q --prompts P --out S --num-generation 8"),  # a renamed flag
    ("merge", "--model Q --adapter A --out M --dtype bf17"),  # a choice that is not one
])
def test_a_stale_command_fails_the_input_check(stage, command, tmp_path):
    # The checks above must fail such a command: `--force true` put `true` under the missing dir as a positional,
    # and click's "unexpected extra argument (.../not-there/true)" named that dir, as the input check does: passed.
    missing, out = tmp_path / "not-there", tmp_path / "out"
    with pytest.raises(AssertionError, match="exit 2"):
        assert_reaches_the_input_check(on_missing_inputs(stage, shell_words(command), missing, out), missing, command)


@pytest.mark.parametrize("stage, command", [
    ("rollout", "--model Q --prompts P --out S --reward gsm8k --reward formatt=0.1"),  # a misspelt reward
    ("train-step", "--model Q --shards S --out A --keep-activations 3"),  # more layers than the model has
    ("eval", "--model M --dataset D --out E --max-new-tokens 40000"),  # more than the model's context
])
def test_a_command_stale_beyond_the_input_check_fails_the_work_check(stage, command, tmp_path, doc_stand_ins):
    # Each passes the input check, which stops before the checks that need the model: `--reward formatt=0.1` planted
    # in docs/rollout.md passed it. Given stand-ins of its inputs, it must fail.
    missing, out = tmp_path / "not-there", tmp_path / "out"
    args = on_missing_inputs(stage, shell_words(command), missing, out)
    assert_reaches_the_input_check(args, missing, command)
    with pytest.raises(AssertionError, match="exit 2"):
        assert_reaches_the_work(args, missing, doc_stand_ins, command)


@pytest.mark.parametrize("stage, command", [("quantize", "src --out q"), ("eval", "--compare runs other")])
def test_a_word_named_as_a_stages_positional_is_a_path(stage, command, tmp_path):
    # `qerl quantize src --out q`: `src` (the source argument's name) was looked up as a flag, and the check died on
    # an AttributeError ('TyperArgument' object has no attribute 'is_flag') instead of running the command.
    missing, out = tmp_path / "not-there", tmp_path / "out"
    assert_reaches_the_input_check(on_missing_inputs(stage, shell_words(command), missing, out), missing, command)


def test_a_synopsis_choice_does_not_end_the_command(tmp_path):
    # docs/quantize.md's synopsis: its `|` was taken for a pipe, so `[--format compressed-tensors` ended the command
    # and neither check saw `--device` (renamed, it stayed on the page).
    page = tmp_path / "page.md"
    page.write_text("```\nqerl quantize SRC --out Q [--format compressed-tensors|modelopt] [--devise auto|cpu]\n```\n")
    [(_, rest, _)] = command_texts(page, STAGE)
    assert synopsis_words(rest) == ["SRC", "--out", "Q", "--format", "compressed-tensors", "--devise", "auto"]


def help_examples(stage: str):
    """(where, words) for every example in `qerl STAGE --help`: each flag's `Example:` (the words after it, a closing
    remark in parentheses left out) and each example command of the stage's own text."""
    from typer.main import get_command

    from qerl_cli.cli import app

    cmd = get_command(app).commands[stage]
    for p in cmd.params:
        text = p.help or ""
        if "Example" in text:
            example = re.sub(r"\s*\([^()]*\)\s*$", "", text[text.index("Example"):].split(":", 1)[1])
            words = shell_words(example.replace("\\[", "["))  # Rich's markup escape
            words = words[2:] if words[:2] == ["qerl", stage] else words  # --compare's example is a whole command
            yield f"{p.opts[0]}'s example", words + [w for w in NEEDS.get(words[0], []) if w not in words]
    for para in textwrap.dedent(cmd.help or "").split("\n\n"):
        for line in para.replace("\\\n", " ").splitlines() if para.startswith("  ") else ():
            for name, rest in re.findall(STAGE + r"(.*)", line):
                if name == stage:
                    yield line.strip(), shell_words(rest)


@pytest.mark.parametrize("stage", STAGES)
def test_every_help_example_parses_and_passes_the_flag_checks(stage, tmp_path, doc_stand_ins):
    # The help's examples are what a user copies first; the same checks as the pages' commands above.
    missing, out = tmp_path / "not-there", tmp_path / "out"
    examples = list(help_examples(stage))
    assert len(examples) >= 5
    for where, words in examples:
        args = on_missing_inputs(stage, words, missing, out)
        assert args is not None, where
        assert_reaches_the_input_check(args, missing, f"qerl {stage} --help, {where}")
        assert_reaches_the_work(args, missing, doc_stand_ins, f"qerl {stage} --help, {where}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_script_and_script_flag_a_page_names_exists(page):
    wrong = []
    for script, found, line in commands(page, r"\b((?:benchmarks|recipes)/[\w/]+\.(?:py|sh))\b"):
        path = ROOT / script
        if not path.exists():
            wrong.append(f"{script} does not exist: {line}")
            continue
        source = path.read_text()
        for mod in re.findall(r"^\s*(?:from|import)\s+(\w+)", source, re.M):  # flags a local helper adds
            if (path.parent / f"{mod}.py").exists():
                source += (path.parent / f"{mod}.py").read_text()
        wrong += [f"{script} {flag}: {line}" for flag in found
                  if flag != "--help" and f'"{flag}"' not in source and f"'{flag}'" not in source]
    assert not wrong, "\n".join(wrong)


def lib_sh_list(name: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'source "$1"; echo "${{{name}[@]}}"', "_", str(ROOT / "recipes" / "lib.sh")],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def test_recipes_page_lists_the_config_keys_lib_sh_reads():
    text = (ROOT / "docs" / "recipes.md").read_text()
    keys = text[text.index("**Config keys**"):text.index("## `recipes/slurm/`")]
    required = re.findall(r"`([A-Z_]+)`", keys[keys.index("Required:"):keys.index("With defaults:")])
    optional = re.findall(r"`([A-Z_]+)`", keys[keys.index("With defaults:"):keys.index("The Qwen2.5")])
    assert required == lib_sh_list("QERL_REQUIRED_VARS")
    # Beyond the keys, that list names the ones it shows by example (SEED as RUN_SEED's default).
    assert set(lib_sh_list("QERL_OPTIONAL_VARS")) <= set(optional) <= set(lib_sh_list("QERL_STAGE_VARS"))


def test_recipes_page_names_only_variables_the_slurm_scripts_read():
    text = (ROOT / "docs" / "recipes.md").read_text()
    variables = text[text.index("Variables: `PARTITION`"):text.index("**Pre-emption and time limits.**")]
    scripts = (ROOT / "recipes" / "slurm" / "submit.sh").read_text() + (ROOT / "recipes" / "slurm" / "stage.sbatch").read_text()
    named = set(re.findall(r"`([A-Z][A-Z_]+)`", variables))
    assert {"PARTITION", "GPU_GRES", "JOB_MEM", "SBATCH"} <= named  # the slice is the list
    assert not {v for v in named if not re.search(rf"\b{v}\b", scripts)}


def test_every_qerl_environment_variable_a_page_names_is_read_somewhere():
    code = "".join(p.read_text(errors="replace") for d in ("qerl_cli", "kernels", "recipes", "benchmarks")
                   for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".sbatch", ".env"))
    named = {v for page in PAGES for v in re.findall(r"\bQERL_[A-Z_]+\b", page.read_text())}
    assert not {v for v in named if not re.search(rf"\b{v}\b", code)}


def test_the_readme_exit_codes_are_the_errors_classes():
    from qerl_cli import errors

    text = (ROOT / "README.md").read_text()
    listed = text[text.index("distinct exit code"):text.index("130 Ctrl-C")]
    codes = {int(c) for c in re.findall(r"\b(\d) [A-Za-z]", listed)}
    classes = {cls.exit_code for cls in vars(errors).values()
               if isinstance(cls, type) and issubclass(cls, errors.QerlError)}
    assert codes == classes == set(range(2, 9))


def test_the_merge_flag_table_names_merge_flags():
    from typer.main import get_command

    from qerl_cli.cli import app

    text = (ROOT / "docs" / "merge-eval.md").read_text()
    table = re.findall(r"^\| `(--[a-z-]+)` \|", text[text.index("## `qerl merge`"):text.index("What happens")], re.M)
    flags = {o for p in get_command(app).commands["merge"].params for o in p.opts}
    assert len(table) >= 8 and not set(table) - flags


def _test_names() -> set[str]:
    return {m for f in (ROOT / "tests").glob("test_*.py") for m in re.findall(r"^def (test_\w+)", f.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_test_a_page_names_exists(page):
    # docs/reliability.md's tables cite a test per guarantee; a renamed or merged test left its row citing nothing.
    # `test_x_*` names every test of that prefix: one must exist.
    names = _test_names()
    named = {n for span in code_lines(page.read_text()) for n in re.findall(r"(?<![\w/.])(test_\w+\*?)(?![\w.]*\.py)", span)}
    missing = sorted(n for n in named if not n.startswith("test_mutation_gaps") and (
        not any(t.startswith(n[:-1]) for t in names) if n.endswith("*") else n not in names))
    assert not missing, f"{page.name} names tests that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_holds_control_characters(page):
    # A page edited through a Python string without the raw prefix turned "\\b" of "\\boxed" into a backspace and
    # "\\n" into a line break inside a code span: merge-eval.md's "Scoring" showed "So oxed{72} or oxed{73}".
    bad = [f"line {n}: {line!r}" for n, line in enumerate(page.read_text().split("\n"), 1)
           if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", line)]
    assert not bad, "\n".join(bad)


def _resolves(dotted: str) -> bool:
    """Whether DOTTED is an importable module, or an attribute path under the longest importable prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def python_names(text: str):
    """Each qerl name a page's code imports or names: `from qerl_cli.x import a, b`, `qerl_cli.x.y`, `qerl_kernels.x`,
    and a bare `module.name` of a qerl_cli / kernels module where the name reads as code (an underscore or a capital:
    `gsm8k_numbers.span_number`, `shards.ShardWriter`; not `data.jsonl`, nor `engine.generate`, a method of an object)."""
    modules = {p.stem: f"qerl_cli.{p.stem}" for p in (ROOT / "qerl_cli").iterdir() if p.suffix == ".py" or p.is_dir()}
    modules.update({p.stem: f"qerl_kernels.{p.stem}" for p in (ROOT / "kernels").glob("*.py")})
    for line in code_lines(text):
        for m in re.finditer(r"\bfrom\s+((?:qerl_cli|qerl_kernels)[\w.]*)\s+import\s+([\w ,]+)", line):
            yield from (f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",") if n.strip())
        yield from re.findall(r"(?<![\w/.])((?:qerl_cli|qerl_kernels)(?:\.\w+)+)", line)
        for mod, name in re.findall(r"(?<![\w/.])([a-z_]+)\.(\w+)(?![\w/.])", line):
            if mod in modules and ("_" in name or name[0].isupper()):
                yield f"{modules[mod]}.{name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_qerl_module_and_name_a_page_cites_exists(page):
    # The answer rules moved from qerl_cli.rewards to qerl_cli.answers (2026-11-27): a page still importing
    # `rewards.span_number` or `qerl_cli.rewards.RULE_VERSION` from the old place fails only when a user pastes it.
    missing = sorted({name for name in python_names(page.read_text()) if not _resolves(name)})
    assert not missing, f"{page.name} names what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_test_cited_with_its_file_is_in_that_file(page):
    # `test_x.py::test_y` sends a reader to one file; the test moved to another file left the row pointing at nothing.
    wrong = [f"{file}::{name}" for span in code_lines(page.read_text())
             for file, name in re.findall(r"(?<!\w)(test_\w+\.py)::(test_\w+)", span)
             if not (ROOT / "tests" / file).is_file()
             or not re.search(rf"^def {name}\b", (ROOT / "tests" / file).read_text(), re.M)]
    assert not wrong, f"{page.name} cites tests not in the file named: {wrong}"


def test_the_readme_gsm8k_rule_counts_are_the_benchmarks():
    # README cites benchmarks/compare_gsm8k_rule.py's totals at its defaults (seeded, CPU, deterministic): a new style
    # or a rule change moves them, and the README kept the old figures.
    import runpy

    from qerl_cli.answers import extract_answer

    bench = runpy.run_path(str(ROOT / "benchmarks" / "compare_gsm8k_rule.py"), run_name="compare_gsm8k_rule")
    rows = bench["cases"](2, 0)  # --per-problem 2 --seed 0, its defaults
    right = sum(extract_answer(text) == want for _, text, want in rows)
    answered = sum(want is not None for *_, want in rows)
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"right on (\d+) of the (\d+) that have an answer, the hand-written rule on (\d+) of all (\d+)", text)
    assert m, "README no longer cites compare_gsm8k_rule's totals in the form this test reads"
    assert (int(m[2]), int(m[3]), int(m[4])) == (answered, right, len(rows))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_metrics_example_records_todays_answer_rule_versions(page):
    # The metrics.json example shows the scorer_version a new eval writes; a rule bumped since left an example that
    # a user's fresh eval contradicts.
    import json

    from qerl_cli.answers import RULE_VERSION

    shown = [json.loads(m) for m in re.findall(r'"scorer_version": (\{[^}]*\})', page.read_text())]
    assert all(v == RULE_VERSION for v in shown), f"{page.name}: {shown} != {RULE_VERSION}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_metrics_example_records_the_math_rules_packages(page):
    # metrics.json's scorer_packages holds the versions of the packages the math rule's verdicts come from
    # (answers.MATH_RULE_PACKAGES, written as rule_packages() writes them): an example with another set, or a
    # misspelt name, sends a user reading their metrics.json after a package that is never there.
    import json

    from qerl_cli.answers import MATH_RULE_PACKAGES, rule_packages

    shown = [json.loads(m) for m in re.findall(r'"scorer_packages": (\{[^}]*\})', page.read_text())]
    assert all(sorted(v) == sorted(MATH_RULE_PACKAGES) == sorted(rule_packages()) for v in shown), \
        f"{page.name}: {shown} != {MATH_RULE_PACKAGES}"
    if page.name == "merge-eval.md":
        assert shown, "merge-eval.md's metrics.json example no longer shows scorer_packages"
