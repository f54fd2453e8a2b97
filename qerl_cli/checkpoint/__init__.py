"""Checkpoint I/O: streaming safetensors reader/writer, source validation, NVFP4 format writers.

- ``safetensors_io``: header parsing, one-tensor reads, a sharded writer with a pre-planned layout.
- ``source``: open and validate a Hugging Face model directory without reading weights.
- ``linears``: which tensors are decoder Linears and which share a global scale.
- ``formats``: compressed-tensors and ModelOpt names and config blocks.
"""

from qerl_cli.checkpoint.formats import FORMATS, NVFP4Format, compressed_tensors_config, modelopt_config
from qerl_cli.checkpoint.linears import SUPPORTED_MODEL_TYPES, LinearName, parse_linear
from qerl_cli.checkpoint.safetensors_io import (
    PlannedTensor,
    ShardedWriter,
    TensorInfo,
    TensorReader,
    read_header,
    read_tensor,
)
from qerl_cli.checkpoint.source import SourceModel, open_source

__all__ = [
    "FORMATS",
    "NVFP4Format",
    "compressed_tensors_config",
    "modelopt_config",
    "SUPPORTED_MODEL_TYPES",
    "LinearName",
    "parse_linear",
    "PlannedTensor",
    "ShardedWriter",
    "TensorInfo",
    "TensorReader",
    "read_header",
    "read_tensor",
    "SourceModel",
    "open_source",
]
