import os

import pytest
import torch

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
