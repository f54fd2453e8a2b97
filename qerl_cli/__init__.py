"""qerl: RL post-training of LLMs on NVFP4 base weights with LoRA and Adaptive Quantization Noise.

Every CLI command is a plain library function here; the CLI (``qerl_cli.cli``) only parses
flags into a config dataclass and calls it.
"""

__version__ = "0.1.0"

from qerl_cli.errors import QerlError  # noqa: E402

__all__ = ["QerlError", "__version__"]
