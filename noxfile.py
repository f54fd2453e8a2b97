"""nox sessions: `tests` (CPU, default), `lint`, `gpu` and `bench` (need a CUDA machine)."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"


def _install(session, extras="dev"):
    # On CPU machines install the CPU torch first, or pip pulls several GB of CUDA wheels.
    if session.posargs[:1] != ["--keep-torch"]:
        session.install("torch==2.13.0")
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session):
    """CPU test suite (what CI runs)."""
    _install(session)
    session.run("python", "-m", "pytest", *[a for a in session.posargs if a != "--keep-torch"])


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", "qerl_cli", "kernels", "tests", "recipes", "benchmarks", "noxfile.py")


@nox.session(venv_backend="none")
def gpu(session):
    """GPU tests, in the current environment (CUDA torch already installed)."""
    session.run("python", "-m", "pip", "install", "-e", ".[dev]", "--no-deps")
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session(venv_backend="none")
def bench(session):
    """Benchmarks on a CUDA machine; each writes its table into docs/benchmarks.md."""
    session.run("python", "-m", "pip", "install", "-e", ".[dev]", "--no-deps")
    for script in session.posargs or ["kernels"]:
        session.run("python", f"benchmarks/bench_{script}.py")
