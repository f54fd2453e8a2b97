"""``trainer_state.json``: what a train-step needs from the previous one besides weights.

Plain JSON (readable with ``jq``), written next to the adapter. It records

- ``global_step``: RL steps taken so far (the adapter in this directory is the policy of
  rollout step ``global_step``); ``optimizer_steps`` counts updates (``--epochs`` per step).
- ``schedule`` and ``last_shards``: a record for people and tools (the step's LR settings and the last LR
  it used; the shard files it read). Not read back: the LR is a pure function of the step and the flags.
- ``rng``: the seed and the torch CPU/CUDA generator states as the step began (restored from the input
  adapter, or seeded with ``--seed`` at a fresh start), restored by the next step: so the same state is
  handed down the whole run, whatever the number of GPUs (after the loop each rank's state would be its own
  last micro-batch's). Dropout masks are drawn from generators seeded per (seed, step, epoch, micro-batch),
  so nothing the step computes depends on this state.
- ``base_model_hash`` and ``lineage`` (hashes of every adapter this one descends from, oldest
  first): a later step refuses a base model or shards that do not belong to this chain.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qerl_cli.errors import BadInputError

STATE_FILE = "trainer_state.json"
STATE_SCHEMA = 1


@dataclass
class TrainerState:
    global_step: int = 0
    optimizer_steps: int = 0
    base_model_hash: str | None = None
    lineage: list[str] = field(default_factory=list)
    schedule: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    lora: dict = field(default_factory=dict)
    last_shards: list[str] = field(default_factory=list)
    schema: int = STATE_SCHEMA

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise BadInputError(f"{path}: unreadable trainer state ({e})") from None
        # bool is an int to isinstance: "global_step": true was read as step 1 (metrics said "step": true)
        if not isinstance(data, dict) or type(data.get("global_step")) is not int:
            raise BadInputError(f"{path}: not a qerl trainer state (no integer global_step)")
        # A negative step is no position on the schedule: under warmup, lr_at gave a negative LR there (gradient
        # ascent, written as a finished step)
        for k in ("global_step", "optimizer_steps"):
            if isinstance(data.get(k), int) and data[k] < 0:
                raise BadInputError(f"{path}: {k} should be >= 0, got {data[k]}",
                                    hint="restore the file from the step that wrote it")
        known = set(cls.__dataclass_fields__)
        # A field of another type (a hand edit, another tool's file) ended the step in a traceback: the RNG
        # state before the loop, optimizer_steps or lineage only after the whole step had run. Checked before
        # the schema comparison below ("schema": "1" > 1 was a TypeError).
        for k, types in _FIELD_TYPES.items():
            v = data.get(k)
            if k in data and (not isinstance(v, types) or isinstance(v, bool)):
                raise BadInputError(f"{path}: {k} should be {' or '.join(t.__name__ for t in types)}, "
                                    f"got {json.dumps(v)[:40]}", hint="restore the file from the step that wrote it")
        if data.get("schema", STATE_SCHEMA) > STATE_SCHEMA:
            raise BadInputError(f"{path}: trainer state schema {data['schema']} is newer than this qerl ({STATE_SCHEMA})")
        if not all(isinstance(h, str) for h in data.get("lineage", [])):
            raise BadInputError(f"{path}: lineage should be a list of adapter hashes")
        rng = data.get("rng") or {}
        # restore_rng reads a key that is present: "torch_cpu": null passed here and failed after the model loaded
        if "torch_cpu" in rng and not (isinstance(rng["torch_cpu"], str) and _is_b64(rng["torch_cpu"])
                                       and len(_unb64(rng["torch_cpu"])) == torch.get_rng_state().numel()):
            raise BadInputError(f"{path}: rng.torch_cpu is not a torch CPU generator state")
        if "torch_cuda" in rng and not (isinstance(rng["torch_cuda"], list)
                                        and all(isinstance(s, str) and _is_b64(s) for s in rng["torch_cuda"])):
            raise BadInputError(f"{path}: rng.torch_cuda is not a list of torch CUDA generator states")
        return cls(**{k: v for k, v in data.items() if k in known})


# Keys transformers' Trainer writes in its own trainer_state.json (a checkpoint-N/ dir of an SFT LoRA run holds
# it beside the PEFT files) and qerl's never does: its global_step counts optimizer steps of another run.
_HF_TRAINER_KEYS = ("log_history", "best_model_checkpoint", "total_flos", "is_world_process_zero")


def foreign_state(path: Path) -> str | None:
    """Who wrote ``path`` when it is not qerl's own trainer state (a Hugging Face Trainer checkpoint's), else None.
    Read as qerl's, its ``global_step`` (the SFT run's optimizer steps, e.g. 500) became the RL schedule position:
    warmup skipped and, past ``--total-steps``, an LR of 0 for every step of the run."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None  # TrainerState.load says what is wrong with it
    if isinstance(data, dict) and "schema" not in data and any(k in data for k in _HF_TRAINER_KEYS):
        return "a Hugging Face Trainer's"
    return None


_FIELD_TYPES = {"optimizer_steps": (int,), "base_model_hash": (str, type(None)), "lineage": (list,),
                "schedule": (dict,), "rng": (dict,), "lora": (dict,), "last_shards": (list,), "schema": (int,)}


def _is_b64(s: str) -> bool:
    try:
        base64.b64decode(s, validate=True)
        return True
    except (ValueError, TypeError):
        return False


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng(seed: int) -> dict:
    out = {"seed": seed, "torch_cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(rng: dict) -> None:
    if "torch_cpu" in rng:
        torch.set_rng_state(_unb64(rng["torch_cpu"]))
    if "torch_cuda" in rng and torch.cuda.is_available():
        states = [_unb64(s) for s in rng["torch_cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
