import os
import sys
from pathlib import Path


def _import_the_installed_kernels_package():
    """`python -m pytest` (tests/run.sh) runs with the repository root on sys.path, where the directory
    kernels/ (installed as qerl_kernels) answers `import kernels`: the name of the Hugging Face package
    that transformers imports whenever that package is installed (transformers.integrations.hub_kernels),
    which then failed with "cannot import name 'CUDAProperties' from 'kernels'". Imported first with the
    root left out, the installed package is the one every later `import kernels` gets."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != root]
    try:
        import kernels  # noqa: F401
    except ImportError:  # not installed: nothing imports it under this name
        pass
    finally:
        sys.path[:] = saved


_import_the_installed_kernels_package()

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Typer reads TERMINAL_WIDTH once, when typer.rich_utils is first imported. Tests that invoke --help with
# TERMINAL_WIDTH=250 in the CliRunner's environment would, if they ran first in a worker, fix every later
# help of that process at 250 columns (test_packaging's width checks then fail, depending on the order).
os.environ.pop("TERMINAL_WIDTH", None)
import typer.rich_utils  # noqa: E402,F401

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def qmodel(tmp_path_factory):
    """(NVFP4 QDIR of the tiny quantized model, its base hash), made once per test module."""
    from tests.train_fixtures import quantized_tiny_with_hash

    return quantized_tiny_with_hash(tmp_path_factory.mktemp("qmodel"))


@pytest.fixture(scope="session")
def doc_stand_ins(tmp_path_factory):
    """Stand-ins of what the documented commands read, by input flag (tests/test_docs.py's build_stand_ins)."""
    from tests.test_docs import build_stand_ins

    return build_stand_ins(tmp_path_factory.mktemp("doc-stand-ins"))
