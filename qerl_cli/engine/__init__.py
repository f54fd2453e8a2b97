"""The native generation engine (nano-vllm style): scheduler, block manager, model runner, sampler.

>>> engine = LLMEngine(model, tokenizer, max_num_seqs=256)
>>> groups = engine.generate(prompt_token_ids, SamplingParams(temperature=1.0, max_new_tokens=512), n=8)
"""

from qerl_cli.engine.sampling_params import Completion, SamplingParams

__all__ = ["Completion", "LLMEngine", "SamplingParams"]


def __getattr__(name: str):
    # LLMEngine imports torch (seconds); the stages' flag checks read sampling_params without it.
    if name == "LLMEngine":
        from qerl_cli.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'qerl_cli.engine' has no attribute {name!r}")
