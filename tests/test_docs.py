"""The docs against the code: every flag, script flag, config key and environment variable a page names exists.

A new user copies commands from README.md and docs/*.md; a renamed flag left there fails only when someone runs
it. docs/benchmarks.md is left out: it keeps the commands of removed probes and reverted experiments on purpose
(its header says so).
"""

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
