"""Adapter lineage: is this adapter being used on the base model it was trained on?

`qerl train-step` records the base model's hash (``qerl_cli.hashing.model_hash``) in the
adapter's trainer_state.json; rollout, merge and eval compare it with the ``--model`` they are
given and refuse a mismatch with both hashes in the message. (train-step itself also checks the
shards' policy hashes: ``qerl_cli.train_step``.)
"""

from __future__ import annotations

import json
from pathlib import Path

from qerl_cli.errors import BadInputError, LineageError
from qerl_cli.hashing import model_hash

TRAINER_STATE = "trainer_state.json"


def recorded_base_hash(adapter_dir: Path) -> str | None:
    """The base-model hash a `qerl train-step` adapter records in trainer_state.json (None if absent)."""
    state_path = Path(adapter_dir) / TRAINER_STATE
    if not state_path.exists():
        return None
    try:
        recorded = json.loads(state_path.read_text()).get("base_model_hash")
    except (ValueError, AttributeError) as e:
        raise BadInputError(f"{state_path}: unreadable trainer state ({e})") from None
    # a hand-edited number here ended rollout, merge and eval in a TypeError traceback (exit 1) while naming it
    if recorded is not None and not isinstance(recorded, str):
        raise BadInputError(f"{state_path}: base_model_hash should be a string or null, got {json.dumps(recorded)[:40]}",
                            hint="restore the file from the step that wrote it")
    return recorded


def check_lineage(adapter_dir: Path, model_dir: Path, base_hash: str | None = None, *,
                  recorded: str | None = None, hint: str = "use the model it was trained on",
                  allow_mismatch: bool = False, override_flag: str | None = "--allow-base-mismatch") -> str:
    """'verified' when the adapter's recorded base hash equals the model's, 'unverified' when the
    adapter records none; LineageError naming both hashes otherwise, unless ``allow_mismatch``
    (e.g. an adapter trained on the NVFP4 base deliberately applied to the bf16 original), which
    returns 'mismatch-allowed' so the manifest says so."""
    recorded = recorded if recorded is not None else recorded_base_hash(adapter_dir)
    if recorded is None:
        return "unverified"
    base_hash = base_hash or model_hash(model_dir)
    if recorded == base_hash:
        return "verified"
    if allow_mismatch:
        return "mismatch-allowed"
    raise LineageError(
        f"--adapter {adapter_dir} was trained on base {recorded[:12]} "
        f"({TRAINER_STATE}) but --model {model_dir} has hash {base_hash[:12]}",
        hint=hint + (f", or pass {override_flag} to apply it anyway" if override_flag else ""),
    )
