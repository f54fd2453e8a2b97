"""Atomic stage outputs: rename-into-place, manifest last, idempotent reruns."""

import json

import pytest

from qerl_cli.errors import OutputExistsError
from qerl_cli.outputs import StageOutput, read_manifest


def _run(out, config, fail=False, force=False):
    so = StageOutput(out, "demo", config=config, inputs={"x": "h1"}, force=force)
    if so.already_done():
        return "done"
    with so as work:
        (work / "a.txt").write_text("hello")
        if fail:
            raise RuntimeError("boom")
    return so.manifest


def test_writes_manifest_with_output_hashes(tmp_path):
    m = _run(tmp_path / "o", {"k": 1})
    assert (tmp_path / "o" / "a.txt").read_text() == "hello"
    assert read_manifest(tmp_path / "o")["outputs"].keys() == {"a.txt"}
    assert m["stage"] == "demo"


def test_rerun_same_inputs_is_already_done(tmp_path):
    _run(tmp_path / "o", {"k": 1})
    assert _run(tmp_path / "o", {"k": 1}) == "done"


def test_changed_inputs_need_force(tmp_path):
    _run(tmp_path / "o", {"k": 1})
    with pytest.raises(OutputExistsError, match="--force"):
        _run(tmp_path / "o", {"k": 2})
    m = _run(tmp_path / "o", {"k": 2}, force=True)
    assert m["config"] == {"k": 2}
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["config"] == {"k": 2}


def test_failure_leaves_nothing_and_keeps_old_output(tmp_path):
    _run(tmp_path / "o", {"k": 1})
    with pytest.raises(RuntimeError):
        _run(tmp_path / "o", {"k": 2}, fail=True, force=True)
    assert read_manifest(tmp_path / "o")["config"] == {"k": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["o"]


def test_dir_without_manifest_is_not_done(tmp_path):
    (tmp_path / "o").mkdir()
    with pytest.raises(OutputExistsError, match="no valid qerl manifest"):
        _run(tmp_path / "o", {"k": 1})
