"""On-disk NVFP4 checkpoint formats: tensor names per quantized Linear, and the config they need.

Both formats hold the same packed E2M1 bytes and the same e4m3 block scales; they differ in
names and in how the per-tensor scale is stored:

- ``compressed-tensors`` (``nvfp4-pack-quantized``, read by vLLM, transformers, llm-compressor):
  ``weight_packed``, ``weight_scale``, ``weight_global_scale`` (fp32 [1], a DIVISOR), and a
  ``quantization_config`` block in config.json. compressed-tensors validates that block with
  pydantic ``extra="forbid"``, so it carries exactly the fields below and nothing else.
- ``modelopt`` (NVIDIA ModelOpt export): ``weight``, ``weight_scale``, ``weight_scale_2``
  (fp32 scalar, a MULTIPLIER = 1/global) and ``hf_quant_config.json``; config.json is left
  without a quantization_config (transformers has no ModelOpt loader; vLLM reads the json file).

A Linear that is not quantized (lm_head, or in-features not a multiple of 16) is listed in
``ignore`` / ``exclude_modules``: loaders otherwise create packed parameters for it and fail
to find them in the checkpoint.
"""

from __future__ import annotations

import torch

from qerl_cli import __version__
from qerl_cli.checkpoint.safetensors_io import PlannedTensor

FORMATS = ("compressed-tensors", "modelopt")
CT_FORMAT = "nvfp4-pack-quantized"


def compressed_tensors_config(ignore: list[str]) -> dict:
    """The exact ``quantization_config`` block for a weight-only NVFP4 (NVFP4A16) checkpoint."""
    return {
        "quant_method": "compressed-tensors",
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": CT_FORMAT,
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "tensor_group",
                    "group_size": 16,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
    }


def modelopt_config(ignore: list[str]) -> dict:
    """``hf_quant_config.json`` for ModelOpt NVFP4 weights (no ``input_scale``: weight-only)."""
    return {
        "producer": {"name": "qerl", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": list(ignore),
        },
    }


class NVFP4Format:
    """Names and encodings of one quantized Linear's tensors in a given format."""

    def __init__(self, name: str):
        if name not in FORMATS:
            raise ValueError(f"unknown format {name!r}; choose one of {FORMATS}")
        self.name = name

    def planned(self, module: str, out_features: int, in_features: int) -> list[PlannedTensor]:
        packed = (out_features, in_features // 2)
        scale = (out_features, in_features // 16)
        if self.name == "compressed-tensors":
            return [
                PlannedTensor(f"{module}.weight_packed", torch.uint8, packed),
                PlannedTensor(f"{module}.weight_scale", torch.float8_e4m3fn, scale),
                PlannedTensor(f"{module}.weight_global_scale", torch.float32, (1,)),
            ]
        return [
            PlannedTensor(f"{module}.weight", torch.uint8, packed),
            PlannedTensor(f"{module}.weight_scale", torch.float8_e4m3fn, scale),
            PlannedTensor(f"{module}.weight_scale_2", torch.float32, ()),
        ]

    def tensors(
        self, module: str, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        """The output tensors of one quantized Linear, in the order ``planned`` lists them."""
        if self.name == "compressed-tensors":
            return [
                (f"{module}.weight_packed", packed),
                (f"{module}.weight_scale", scale),
                (f"{module}.weight_global_scale", global_scale.reshape(1).to(torch.float32)),
            ]
        # ModelOpt multiplies by weight_scale_2 where compressed-tensors divides by the global.
        return [
            (f"{module}.weight", packed),
            (f"{module}.weight_scale", scale),
            (f"{module}.weight_scale_2", torch.reciprocal(global_scale.reshape(()).to(torch.float32))),
        ]

    def update_config(self, config: dict, ignore: list[str]) -> dict:
        # A source's `"quantization_config": null` (a plain model) is not carried over as a null block.
        null = ("quantization_config", "compression_config")
        config = {k: v for k, v in config.items() if not (k in null and v is None)}
        if self.name == "compressed-tensors":
            config["quantization_config"] = compressed_tensors_config(ignore)
        return config

    def extra_files(self, ignore: list[str]) -> dict[str, dict]:
        if self.name == "modelopt":
            return {"hf_quant_config.json": modelopt_config(ignore)}
        return {}
