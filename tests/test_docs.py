"""The docs against the code: every flag, script flag, config key and environment variable a page names exists.

A new user copies commands from README.md and docs/*.md; a renamed flag left there fails only when someone runs
it. docs/benchmarks.md is left out: it keeps the commands of removed probes and reverted experiments on purpose
(its header says so).
"""

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
STAGES = ("quantize", "rollout", "train-step", "merge", "eval")
FLAG = r"(?<![\w-])--[a-z][a-z0-9-]*"


def code_lines(text: str):
    """Each line of a fenced block (backslash continuations joined) and each inline `code` span."""
    for block in re.findall(r"```.*?```", text, re.S):
        yield from block.replace("\\\n", " ").splitlines()
    yield from re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def commands(page: Path, start: str):
    """(name, its flags) for each command a code line of PAGE runs: START's group names it, up to the next command."""
    for line in code_lines(page.read_text()):
        for m in re.finditer(start + r"(.*)", line):
            rest = re.split(start + r"|[;|#]|&&", m.group(2))[0]
            yield m.group(1), re.findall(FLAG, rest), line.strip()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_stage_flag_a_page_names_exists(page):
    from typer.main import get_command

    from qerl_cli.cli import app

    flags = {name: {o for p in cmd.params for o in p.opts + p.secondary_opts} | {"--help"}
             for name, cmd in get_command(app).commands.items()}
    wrong = [f"qerl {stage} {flag}: {line}" for stage, found, line in
             commands(page, r"\b(?:qerl|qerl_cli)\s+(" + "|".join(STAGES) + r")\b") for flag in found
             if flag not in flags[stage]]
    assert not wrong, "\n".join(wrong)


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
    `answers.span_number`, `shards.ShardWriter`; not `data.jsonl`, nor `engine.generate`, a method of an object)."""
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
