"""What makes a checkpoint complete (pure Python, one process, plus one DCP save without a group).

- The manifest checksums itself: a digit changed in its ``extra`` (the loss history) is refused
  naming ``manifest.json``, while a re-indented manifest still verifies.  DCP's ``.metadata`` is
  one of the checksummed files, so an edit of it is refused too.
- Complete means every listed file is present with its size: a step directory whose data file a
  kill removed is not listed, and a prune killed while deleting a step never leaves a
  ``step-<N>`` that looks complete (the step is renamed aside first).
- The step directories that are not complete are reported with the reason, so a resume can say
  which it skipped and why.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest

from hp_checkpoint import manifest as cm
from hp_checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointKind,
    Framework,
    Manifest,
    TensorEntry,
    commit,
    complete_checkpoints,
    file_entries,
    prune,
    staging_dir,
    verify_checkpoint,
    write_manifest,
)


def _save(root: str, step: int, losses: list[float] | None = None) -> str:
    stage = staging_dir(root, step)
    for name, payload in (("__0_0.distcp", b"a" * 2000), ("__1_0.distcp", b"b" * 1000), (".metadata", b"m" * 50)):
        with open(os.path.join(stage, name), "wb") as f:
            f.write(payload)
    files = file_entries(stage, ["__0_0.distcp", "__1_0.distcp", ".metadata"])
    extra = {"losses": losses if losses is not None else [7.125, 6.5, 5.875], "step": step}
    write_manifest(stage, Manifest(Framework.TORCH, CheckpointKind.DCP, step, files,
                                   {"w": TensorEntry((4, 3), "float32")}, extra))
    return commit(stage, root, step)


def test_an_edited_digit_of_the_manifest_is_refused(tmp_path: Any) -> None:
    root = str(tmp_path)
    path = _save(root, 4)
    mpath = os.path.join(path, MANIFEST_NAME)
    text = open(mpath).read()
    assert text.count("6.5") == 1
    # re-indenting changes no value: still verifies
    with open(mpath, "w") as f:
        json.dump(json.loads(text), f, indent=4)
    assert verify_checkpoint(path).extra["losses"] == [7.125, 6.5, 5.875]
    # one digit of the loss history
    with open(mpath, "w") as f:
        f.write(text.replace("6.5", "6.4"))
    with pytest.raises(CheckpointError, match=r"manifest\.json was changed after it was written"):
        verify_checkpoint(path)
    assert complete_checkpoints(root) == []
    # the checksum field itself removed: refused as well
    raw = json.loads(text)
    del raw[cm.SELF_CHECKSUM]
    with open(mpath, "w") as f:
        json.dump(raw, f)
    with pytest.raises(CheckpointError, match=r"has no 'manifest_sha256'"):
        verify_checkpoint(path)


def test_dcp_metadata_is_listed_and_checked(tmp_path: Any) -> None:
    import torch

    from hp_checkpoint.atomic import load_checkpoint, save_checkpoint

    path = save_checkpoint({"x": torch.arange(6.0)}, str(tmp_path), 1)
    assert ".metadata" in verify_checkpoint(path).files
    with open(os.path.join(path, ".metadata"), "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x20]))
    with pytest.raises(CheckpointError, match=r"file '\.metadata' is corrupted"):
        load_checkpoint({"x": torch.zeros(6)}, path)


def test_a_step_with_a_missing_file_is_not_complete(tmp_path: Any) -> None:
    root = str(tmp_path)
    _save(root, 2)
    damaged = _save(root, 4)
    os.remove(os.path.join(damaged, "__1_0.distcp"))  # e.g. a kill during an old-style prune
    assert [s for s, _ in complete_checkpoints(root)] == [2]
    short = _save(root, 6)
    os.truncate(os.path.join(short, "__0_0.distcp"), 10)
    assert [s for s, _ in complete_checkpoints(root)] == [2]


def test_a_prune_killed_while_deleting_never_leaves_a_complete_looking_step(tmp_path: Any, monkeypatch: Any) -> None:
    root = str(tmp_path)
    for step in (1, 2, 3):
        _save(root, step)
    real_rmtree = shutil.rmtree

    def killed_midway(path: str, *args: Any, **kwargs: Any) -> None:
        # the first data file goes, then the process dies
        os.remove(os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]))
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(cm.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prune(root, keep=2)
    monkeypatch.setattr(cm.shutil, "rmtree", real_rmtree)
    assert [s for s, _ in complete_checkpoints(root)] == [2, 3]
    # no step-<N> name is left for the half-deleted one; the next prune removes what is left of it
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000002", "step-00000003"]
    leftovers = [n for n in os.listdir(root) if n.startswith(".pruned-step-00000001-")]
    assert len(leftovers) == 1
    assert prune(root, keep=2) == [os.path.join(root, leftovers[0])]
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003"]


def test_incomplete_steps_are_reported_with_the_reason(tmp_path: Any) -> None:
    from hp_checkpoint.manifest import scan_checkpoints

    root = str(tmp_path)
    _save(root, 4)
    os.remove(os.path.join(_save(root, 5), MANIFEST_NAME))
    os.makedirs(os.path.join(root, "step-00000006"))
    os.remove(os.path.join(_save(root, 7), "__1_0.distcp"))
    with open(os.path.join(_save(root, 8), MANIFEST_NAME), "a") as f:
        f.write("}")
    complete, skipped = scan_checkpoints(root)
    assert [s for s, _ in complete] == [4]
    reasons = {s.step: s.reason for s in skipped}
    assert reasons == {
        5: "no manifest.json, so the save that wrote it did not finish",
        6: "the directory is empty (its save did not start writing, or its files were removed)",
        7: "file '__1_0.distcp' is missing (the manifest lists it with 1000 bytes)",
        8: reasons[8],
    }
    assert reasons[8].startswith("manifest.json is not valid JSON")
    assert all(s.path == os.path.join(root, f"step-{s.step:08d}") for s in skipped)


def test_clear_removes_every_checkpoint_and_nothing_else(tmp_path: Any) -> None:
    from hp_checkpoint.manifest import clear_checkpoints

    root = str(tmp_path)
    for step in (1, 2):
        _save(root, step)
    os.makedirs(os.path.join(root, "step-00000003"))
    staging_dir(root, 4)
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("mine")
    removed = clear_checkpoints(root)
    assert len(removed) == 4 and sorted(os.listdir(root)) == ["notes.txt"]
