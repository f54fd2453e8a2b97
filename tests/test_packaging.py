"""The install metadata lists every subpackage, and the CLI spine answers."""

import hashlib
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (requires-python >= 3.10); [dev] installs tomli there
    import tomli as tomllib
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qerl_cli").rglob("__init__.py")}
    found |= {"qerl_kernels" + "".join("." + s for s in p.parent.relative_to(ROOT / "kernels").parts)
              for p in (ROOT / "kernels").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


def test_license_file_is_the_apache_text_pyproject_declares():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    # The Apache Software Foundation's LICENSE-2.0.txt, unmodified (md5 of the published file).
    assert hashlib.md5(text.encode()).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"


def test_help_lists_every_stage():
    from qerl_cli.cli import app

    out = CliRunner().invoke(app, ["--help"])
    assert out.exit_code == 0
    for name in ("quantize", "rollout", "train-step", "merge", "eval"):
        assert name in out.output


def test_every_flag_that_takes_a_value_has_an_example():
    # The README: "qerl STAGE --help explains every flag with an example" (on/off switches need none).
    from typer.main import get_command

    from qerl_cli.cli import app

    for name, cmd in get_command(app).commands.items():
        missing = [p.opts[0] for p in cmd.params
                   if p.param_type_name == "option" and not p.is_flag and "Example" not in (p.help or "")]
        assert not missing, f"qerl {name}: no example in the help of {missing}"


@pytest.mark.parametrize("columns", [80, 100, 140])
def test_stage_help_never_cuts_a_flag_name_short(columns):
    # Rich squeezes its option table on a narrow terminal until names read "--prompts-per-s…";
    # there the plain layout takes over (qerl_cli.cli.StageCommand).
    from typer.main import get_command

    from qerl_cli.cli import RICH_HELP_MIN_COLUMNS, app

    for name, cmd in get_command(app).commands.items():
        out = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""})
        assert out.exit_code == 0, out.output
        text = out.output
        assert "…" not in text, f"qerl {name} --help at {columns} columns truncates:\n{text}"
        assert ("╭" in text) == (columns >= RICH_HELP_MIN_COLUMNS)  # Rich's panels only where they fit
        assert max(len(line) for line in text.splitlines()) <= columns
        words = set(re.findall(r"--[a-z][a-z0-9-]*", text))
        for p in cmd.params:
            for opt in p.opts + p.secondary_opts:
                assert not opt.startswith("--") or opt in words, f"qerl {name}: {opt} missing from its help"
        if columns < RICH_HELP_MIN_COLUMNS:
            assert "\\[" not in text  # Rich's escapes mean nothing in the plain layout
        bare = CliRunner().invoke(app, [name], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""})
        assert bare.exit_code == 2 and "Usage:" in bare.output and "--force" in bare.output, bare.output  # no args: the help


def test_kernels_import_under_qerl_name():
    import qerl_kernels.reference as ref

    assert ref.GROUP == 16


def test_every_core_dependency_imports():
    # Tests that need one of these skip where it is missing (the device machines lack compressed-tensors);
    # here, where the project is installed, a missing one must fail instead of silently skipping them.
    import importlib
    import platform
    import re

    import_names = {"compressed-tensors": "compressed_tensors", "math-verify": "math_verify"}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        spec, _, marker = dep.partition(";")
        if "platform_system == 'Linux'" in marker and platform.system() != "Linux":
            continue
        name = re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0]
        importlib.import_module(import_names.get(name, name.replace("-", "_")))


def test_version_names_qerl_and_every_dependency_without_importing_torch():
    # `qerl --version` is what a bug report asks for: qerl's own version (the one pyproject installs)
    # and every dependency's, answered from metadata in a process that never imports torch.
    import subprocess
    import sys

    import qerl_cli

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == qerl_cli.__version__
    probe = ("import sys; from qerl_cli.cli import main; sys.argv = ['qerl', '--version']\n"
             "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
             "assert 'torch' not in sys.modules, 'qerl --version imported torch'")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"qerl {qerl_cli.__version__}"
    from qerl_cli.cli import VERSION_DISTRIBUTIONS, app

    for dist in VERSION_DISTRIBUTIONS:
        assert any(re.fullmatch(rf"  {re.escape(dist)} (\S+|not installed)", line) for line in lines), dist
    assert re.search(r"^  torch \d", out.stdout, re.M)  # installed here, so a version, not "not installed"
    short = CliRunner().invoke(app, ["-V"])
    assert short.exit_code == 0 and short.output.splitlines()[0] == lines[0]


@pytest.mark.parametrize("columns", [60, 80])
def test_wrapped_help_examples_still_paste_into_a_shell(columns):
    # A wrapped example line continued without a trailing backslash: pasted, the shell ran half of it
    # (train-step's torchrun example at 80 columns; audit).
    import shlex
    import textwrap

    from typer.main import get_command

    from qerl_cli.cli import app

    for name, cmd in get_command(app).commands.items():
        src = [p for p in textwrap.dedent(cmd.help or "").strip("\n").split("\n\n") if p.startswith("  ")]
        text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""}).output
        shown = [p for p in text.split("\n\n") if p.startswith("    ")]  # examples sit two deeper than prose
        assert len(shown) == len(src), (name, shown)
        for want, got in zip(src, shown):
            def commands(p):  # a comment wraps into comment lines of its own (the bash test below runs them)
                return [x for x in p.replace("\\\n", " ").splitlines() if not x.lstrip().startswith("#")]

            for w_cmd, g_cmd in zip(commands(want), commands(got)):
                assert shlex.split(g_cmd) == shlex.split(w_cmd), (name, got)


@pytest.mark.parametrize("columns", [80, 140])
def test_a_switch_shows_no_value_type_in_the_help(columns):
    # Typer's Rich table put `<bool>` beside --force, --quiet, --help and every other switch, as if each took a
    # value (`--force true` is an error); the plain layout shows none.
    from qerl_cli.cli import app

    for args in (["--help"], *([name, "--help"] for name in ("quantize", "rollout", "train-step", "merge", "eval"))):
        text = CliRunner().invoke(app, args, env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""}).output
        assert "--help" in text and "<bool>" not in text, (args, text)


@pytest.mark.parametrize("columns", [60, 80, 100])
def test_a_wrapped_help_example_keeps_each_flag_with_its_value(columns):
    # Wrapped at the space after a flag, an example read `... --out \` / `runs/merged-bf16` (merge, 80 columns) and
    # `Example: --adapter` / `runs/step-0100`: a flag without its value on the line. Each pair that fits on a line is
    # on one, in the example commands and (plain layout) in each flag's example.
    import textwrap

    from typer.main import get_command

    from qerl_cli.cli import RICH_HELP_MIN_COLUMNS, app

    pair = re.compile(r"(?<!\S)(--?[A-Za-z][\w-]*) ([^\s'\"$-]\S*)")
    for name, cmd in get_command(app).commands.items():
        sources = [p for p in textwrap.dedent(cmd.help or "").split("\n\n") if p.startswith("  ")]
        if columns < RICH_HELP_MIN_COLUMNS:  # Rich wraps the flags' own help itself
            sources += [h[h.index("Example"):] for h in (p.help or "" for p in cmd.params) if "Example" in h]
        pairs = {f"{flag} {value}" for src in sources for line in src.splitlines() if not line.lstrip().startswith("#")
                 for flag, value in pair.findall(line)}
        text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""}).output
        lines = text.splitlines()
        split = sorted(p for p in pairs if len(p) <= columns - 40 and not any(p in line for line in lines))
        assert not split, (name, split)


@pytest.mark.parametrize("columns", [60, 80])
def test_a_quoted_example_value_is_never_wrapped_inside(columns):
    # `--system-prompt 'You are a careful` / `mathematician.'`: pasted, the value held a newline and spaces.
    import re

    from typer.main import get_command

    from qerl_cli.cli import app

    quoted = re.compile(r"\$?'[^'\n]*'|\"[^\"\n]*\"")
    for name, cmd in get_command(app).commands.items():
        want = {m[0] for p in cmd.params for m in quoted.finditer((p.help or "")[(p.help or "").find("Example"):])
                if "Example" in (p.help or "")}
        text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""}).output
        for value in want:
            assert value in text, (name, value)  # on one line, as written


@pytest.mark.parametrize("args,needle", [
    (["rollout", "--model", "q", "--out", "x"], "Missing option '--prompts'"),
    (["rollout", "--model", "q", "--out", "x", "--prompts", "p", "--step", "abc"], "'--step'"),
    (["train-step", "--loss"], "'--loss' requires an argument"),
    (["eval", "--bogus", "1"], "No such option: --bogus"),
    (["rolout"], "No such command 'rolout'"),
    (["--bogus"], "No such option: --bogus"),
])
def test_a_flag_parsing_error_is_one_error_line(args, needle):
    # Click printed the usage, a hint and a Rich box: five lines and no `error:` (docs audit, session 44)
    from typer.testing import CliRunner

    from qerl_cli.cli import app
    from tests.reliability_fixtures import assert_one_line_error

    r = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    line = assert_one_line_error(r, 2, needle)
    assert "--help`)" in line and r.stdout == ""


def test_a_caller_running_the_app_not_standalone_gets_clicks_exception():
    # the one-line form is for the command; app(..., standalone_mode=False) raised click's error before and
    # still does (review, session 44: it had become SystemExit 2)
    from qerl_cli.cli import _click_exceptions, app

    with pytest.raises(_click_exceptions().UsageError, match="No such option: --bogus"):
        app(["rollout", "--bogus"], standalone_mode=False)
    with pytest.raises(_click_exceptions().UsageError, match="No such command"):
        app(["rolout"], standalone_mode=False)


def test_sdist_carries_every_tracked_file(tmp_path):
    # MANIFEST.in: the sdist carries what its tests and the README's commands need. benchmarks/ was left
    # out: from the sdist, tests/test_bench_harness.py and test_train_memory.py failed (ModuleNotFoundError
    # bench_kernels; no benchmarks/bench_train.py) and `nox -s lint` stopped on "benchmarks: No such file".
    import shutil
    import subprocess
    import sys
    import tarfile

    pytest.importorskip("setuptools", minversion="77")  # what pyproject's build-system requires
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ls = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if ls.returncode != 0:
        pytest.skip("git ls-files failed")
    tracked = {f for f in ls.stdout.decode().split("\0") if f and (ROOT / f).is_file()}
    src = tmp_path / "src"  # a copy of the tracked files: the build writes egg-info into its source tree
    for f in tracked:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # With no directory holding qerl's kernels/ on sys.path (pip runs a backend without the source tree there):
    # `kernels.locking`, an egg_info writer the Hugging Face package `kernels` registers, was looked up in it.
    build = ("import os, sys; sys.path[:] = [p for p in sys.path if not os.path.isfile("
             "os.path.join(p or os.curdir, 'kernels', 'twiddle_triton.py'))]\n"
             "from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")],
                         cwd=src, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    name = out.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / "dist" / name) as tar:
        shipped = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    missing = sorted(tracked - shipped - {".gitignore"})
    assert not missing, f"MANIFEST.in leaves these tracked files out of the sdist: {missing[:10]}"


def test_the_tests_read_toml_on_every_supported_python():
    # requires-python >= 3.10, but tomllib is 3.11+: on 3.10 `import tomllib` at the top of this module
    # stopped the whole suite at collection ("Interrupted: 1 error during collection").
    import ast

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if not re.fullmatch(r">=\s*3\.(10|[0-9])", meta["requires-python"]):
        return  # no Python without tomllib is supported
    assert any(re.match(r"tomli\b.*;\s*python_version\s*<\s*['\"]3\.11['\"]", d)
               for d in meta["optional-dependencies"]["dev"]), "the [dev] extra must install tomli on 3.10"
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                   and any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                           for h in t.handlers)
                   for s in t.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "tomllib" for a in node.names):
                assert id(node) in guarded, f"{path.name}:{node.lineno}: `import tomllib` without a tomli fallback"


@pytest.mark.parametrize("columns", [60, 80, 100, 140])
def test_every_help_example_runs_in_bash_as_written(columns):
    # What a user pastes is what the shell runs: bash ends a comment at its newline, so a comment wrapped with
    # ` \` ran its second half as a command (plain layout); and Rich's layout (>= 100 columns) wrapped a long
    # example bare, so the first line ran alone (`--reward format=0.1` dropped) and the rest as commands.
    # Lines are pasted without the trailing blanks Rich pads them with, as terminals copy them.
    import subprocess
    import textwrap

    from typer.main import get_command

    from qerl_cli.cli import app

    stub = "qerl() { printf '<%s>' qerl \"$@\"; echo; }; torchrun() { printf '<%s>' torchrun \"$@\"; echo; }\n"

    def run(script):
        out = subprocess.run(["bash", "-c", stub + script], capture_output=True, text=True, timeout=60)
        return out.returncode, out.stdout, out.stderr

    def examples(text):
        paras = "\n".join(line.rstrip() for line in text.splitlines()).split("\n\n")
        return "\n\n".join(textwrap.dedent(p) for p in paras if p.lstrip().startswith(("qerl ", "torchrun ", "#")))

    for name, cmd in get_command(app).commands.items():
        want = run(examples(textwrap.dedent(cmd.help or "")))
        assert want[0] == 0 and want[1].count("<qerl>") + want[1].count("<torchrun>") >= 1, (name, want)
        text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": ""}).output
        got = run(examples(text))
        assert got == want, (name, columns, got, want)


def test_a_path_flag_after_equals_takes_tilde_as_home(tmp_path, monkeypatch):
    # `--out=~/x`: the shell expands no `~` after `=`, and quantize wrote ./~/x under the working directory
    # while it printed `wrote ~/x`; `--model=~/q` and `--prompts=~/p.jsonl` were "not found" though they exist.
    from qerl_cli.assets import tiny_model_dir
    from qerl_cli.cli import app

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    out = CliRunner().invoke(app, ["quantize", str(tiny_model_dir()), "--out=~/q", "--device", "cpu", "-q"])
    assert out.exit_code == 0, out.output
    assert (home / "q" / "manifest.json").is_file() and not (work / "~").exists()
    assert str(home / "q") in out.output


def test_string_path_flags_take_tilde_as_home_too(tmp_path, monkeypatch):
    # --shards (a glob), --prompt-template (text or a file) and --reward FILE.py:fn are strings, not Paths, so the
    # `~` the shell leaves after `=` reached them as written: "shard path ~/ro does not exist", a template file
    # "must contain {prompt}", a reward file "does not exist" (a review of the first fix).
    from qerl_cli.data import load_template
    from qerl_cli.rewards import parse_reward_specs
    from qerl_cli.shards import resolve_shard_files

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "shard-00000-of-00001.jsonl").write_text("")
    (tmp_path / "t.txt").write_text("Q: {prompt}\nA:")
    (tmp_path / "r.py").write_text("def fn(completion, answer, prompt=None):\n    return 1.0\n")
    assert resolve_shard_files("~/ro") == [tmp_path / "ro" / "shard-00000-of-00001.jsonl"]
    assert resolve_shard_files("~/ro/shard-*.jsonl") == [tmp_path / "ro" / "shard-00000-of-00001.jsonl"]
    assert load_template("~/t.txt") == "Q: {prompt}\nA:"
    (spec,) = parse_reward_specs(["~/r.py:fn"])
    assert spec.reward("x", "y") == 1.0


def test_the_installed_kernels_package_is_not_shadowed_by_the_repositorys_kernels_dir(tmp_path):
    # `python -m pytest` from the root (tests/run.sh) puts the root on sys.path, where kernels/ (installed as
    # qerl_kernels) answered `import kernels`, the Hugging Face package's name: with that package installed,
    # transformers' modeling_utils failed to import ("cannot import name 'CUDAProperties' from 'kernels'").
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the installed kernels package'\n")
    probe = (f"import sys; sys.path.insert(1, {str(site)!r})\n"
             "import tests.conftest\n"
             "import kernels, qerl_kernels.reference\n"
             "print(kernels.CUDAProperties)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "the installed kernels package"


def test_typer_floor_runs_with_the_click_pip_installs_beside_it():
    # typer declares click >= 8.0 with no upper bound, so pip pairs any typer with the newest click. With
    # click >= 8.2, typer 0.12-0.15 raised TypeError on every `qerl` command (even --version) and 0.16-0.17
    # printed a traceback for a missing required option (`qerl rollout --model q --out x`); 0.18 is the first
    # that gives the one-line error.
    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (typer,) = [d for d in deps if re.match(r"typer\b", d)]
    floor = re.search(r">=\s*([0-9.]+)", typer)
    assert floor and Version(floor.group(1)) >= Version("0.18"), typer
