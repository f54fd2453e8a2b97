import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
