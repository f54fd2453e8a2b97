"""Which checkpoint tensors are decoder Linears, and which of them vLLM fuses.

Llama, Qwen2/2.5, Qwen3 and Mistral share Hugging Face's naming:
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` and ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``.
vLLM loads q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` with a single global
scale per fused layer, so those siblings must share one: the minimum of their own globals
(the one that keeps the largest amax inside the fp8 scale range), as llm-compressor does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

_LINEAR = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<block>self_attn|mlp)\."
    r"(?P<proj>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)
# Fused siblings, in the order vLLM concatenates them.
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}


@dataclass(frozen=True)
class LinearName:
    module: str  # e.g. model.layers.3.self_attn.q_proj
    layer: str  # e.g. model.layers.3
    proj: str  # e.g. q_proj

    @property
    def fusion_key(self) -> str:
        """Tensors with the same key share one global scale; unfused projections get their own key."""
        return f"{self.layer}.{FUSED.get(self.proj, self.proj)}"

    @property
    def order(self) -> int:
        return _ORDER.get(self.proj, 0)


def parse_linear(tensor_name: str) -> LinearName | None:
    """The Linear a ``*.weight`` tensor belongs to, or None when it is not a decoder Linear."""
    m = _LINEAR.match(tensor_name)
    if m is None:
        return None
    module = tensor_name[: -len(".weight")]
    return LinearName(module=module, layer=m["layer"], proj=m["proj"])
