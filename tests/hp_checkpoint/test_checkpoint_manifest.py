"""Checkpoint manifests and the checkpoint root (pure Python, one process): a committed
checkpoint verifies; a damaged byte, a truncated file, a missing file, a missing or malformed
manifest and a wrong tensor shape/dtype are each refused with their own message naming the file
or tensor; staging directories are never complete checkpoints; prune keeps the newest."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest

from hp_checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointKind,
    FileEntry,
    Framework,
    Manifest,
    TensorEntry,
    check_checksums,
    check_tensor,
    check_tensors,
    commit,
    complete_checkpoints,
    file_entries,
    file_entry,
    newest_complete,
    prune,
    read_manifest,
    staging_dir,
    verify_checkpoint,
    write_manifest,
)

_TENSORS = {"w": TensorEntry((4, 3), "float32"), "b": TensorEntry((3,), "bfloat16")}


def _save(root: str, step: int, payload: bytes = b"x" * 3000, *, commit_it: bool = True) -> str:
    """A checkpoint of two files (one in a subdirectory) the way a save writes it."""
    stage = staging_dir(root, step)
    os.makedirs(os.path.join(stage, "sub"))
    with open(os.path.join(stage, "__0_0.distcp"), "wb") as f:
        f.write(payload)
    with open(os.path.join(stage, "sub", ".metadata"), "wb") as f:
        f.write(b"meta" + bytes([step % 256]))
    files = file_entries(stage, ["__0_0.distcp", "sub/.metadata"])
    manifest = Manifest(Framework.TORCH, CheckpointKind.DCP, step, files, _TENSORS, {"losses": [1.5, 2.0]})
    write_manifest(stage, manifest)
    return commit(stage, root, step) if commit_it else stage


def test_round_trip_and_file_entry(tmp_path: object) -> None:
    root = str(tmp_path)
    payload = random.Random(0).randbytes(3 * (1 << 20) + 17)  # > one read chunk
    path = _save(root, 7, payload)
    assert os.path.basename(path) == "step-00000007"
    m = verify_checkpoint(path)
    assert m.step == 7 and m.framework == "torch" and m.kind is CheckpointKind.DCP
    assert m.files["__0_0.distcp"] == FileEntry(len(payload), hashlib.sha256(payload).hexdigest())
    assert m.tensors == _TENSORS and m.extra == {"losses": [1.5, 2.0]}
    assert file_entry(os.path.join(path, "__0_0.distcp")).sha256 == hashlib.sha256(payload).hexdigest()
    raw = json.load(open(os.path.join(path, MANIFEST_NAME)))
    assert raw["format"] == "hyper-parallel-checkpoint" and raw["version"] == 1
    assert raw["tensors"]["w"] == {"shape": [4, 3], "dtype": "float32"}
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # the staging dir became the checkpoint


def test_damaged_byte_is_refused_naming_the_file(tmp_path: object) -> None:
    path = _save(str(tmp_path), 1)
    target = os.path.join(path, "__0_0.distcp")
    with open(target, "r+b") as f:
        f.seek(1234)
        f.write(b"y")
    verify_checkpoint(path, check_hashes=False)  # same size: only the checksum sees it
    with pytest.raises(CheckpointError, match=r"file '__0_0\.distcp' is corrupted: its sha256"):
        verify_checkpoint(path)


def test_checksum_shares_cover_every_file_once(tmp_path: object) -> None:
    """Ranks that each check their share of the checksums together find any one damaged file:
    exactly one share of n reports it, for each file and each n."""
    path = _save(str(tmp_path), 1)
    for i in range(5):  # three more files: five in all
        with open(os.path.join(path, f"extra-{i}"), "wb") as f:
            f.write(bytes([i]) * 100)
    m = read_manifest(path)
    m = Manifest(m.framework, m.kind, m.step, {**m.files, **file_entries(path, [f"extra-{i}" for i in range(5)])},
                 m.tensors, m.extra)
    names = sorted(m.files)
    trials = 0
    for victim in names:
        target = os.path.join(path, victim)
        original = open(target, "rb").read()
        with open(target, "r+b") as f:
            f.write(bytes([original[0] ^ 1]))
        for n in (1, 2, 3, 4, 8):
            found = []
            for i in range(n):
                try:
                    check_checksums(path, m, share=(i, n))
                except CheckpointError as e:
                    assert f"file {victim!r} is corrupted" in str(e), e
                    found.append(i)
            assert len(found) == 1, (victim, n, found)
            trials += 1
        with open(target, "wb") as f:
            f.write(original)
    check_checksums(path, m)
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="share must be"):
            check_checksums(path, m, share=bad)
    print(f"\nchecksum shares: {trials} (file, ranks) trials, each damaged file found by exactly one share")


def test_truncated_file_is_refused(tmp_path: object) -> None:
    path = _save(str(tmp_path), 1)
    os.truncate(os.path.join(path, "__0_0.distcp"), 100)
    with pytest.raises(CheckpointError, match=r"file '__0_0\.distcp' is truncated: 100 bytes, the manifest says 3000"):
        verify_checkpoint(path, check_hashes=False)


def test_missing_file_is_refused(tmp_path: object) -> None:
    path = _save(str(tmp_path), 1)
    os.remove(os.path.join(path, "sub", ".metadata"))
    with pytest.raises(CheckpointError, match=r"file 'sub/\.metadata' is missing"):
        verify_checkpoint(path)


def test_missing_manifest_means_incomplete(tmp_path: object) -> None:
    stage = _save(str(tmp_path), 3, commit_it=False)
    os.remove(os.path.join(stage, MANIFEST_NAME))
    with pytest.raises(CheckpointError, match=r"no manifest\.json, so the save that wrote it did not finish"):
        verify_checkpoint(stage)
    with pytest.raises(CheckpointError, match="did not finish"):
        commit(stage, str(tmp_path), 3)


def _edit(key: str, raw: dict) -> None:
    if key == "no-step":
        del raw["step"]
    elif key == "step-str":
        raw["step"] = "2"
    elif key == "version":
        raw["version"] = 2
    elif key == "framework":
        raw["framework"] = "jax"
    elif key == "sha":
        raw["files"]["__0_0.distcp"]["sha256"] = "abc"
    elif key == "escape":
        raw["files"]["../evil"] = raw["files"].pop("__0_0.distcp")
    elif key == "shape":
        raw["tensors"]["w"]["shape"] = [4, -1]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("text:{not json", "is not valid JSON"),
        ("text:[1, 2]", "is a JSON list, not an object"),
        ('text:{"format": "other"}', "has format 'other'"),
        ("no-step", "has no 'step'"),
        ("step-str", "has 'step' of type str"),
        ("version", "is format version 2; this library reads version 1"),
        ("framework", "has framework 'jax'"),
        ("sha", "invalid size/sha256 for file '__0_0.distcp'"),
        ("escape", "lists file '../evil'"),
        ("shape", "invalid shape for tensor 'w'"),
    ],
)
def test_bad_manifest_is_refused(tmp_path: object, edit: str, message: str) -> None:
    path = _save(str(tmp_path), 2)
    mpath = os.path.join(path, MANIFEST_NAME)
    if edit.startswith("text:"):
        text = edit[len("text:"):]
    else:
        raw = json.load(open(mpath))
        _edit(edit, raw)
        text = json.dumps(raw)
    with open(mpath, "w") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(path)
    assert complete_checkpoints(str(tmp_path)) == []  # an unreadable manifest is not a complete checkpoint


def test_wrong_shape_or_dtype_is_refused_naming_the_tensor(tmp_path: object) -> None:
    m = verify_checkpoint(_save(str(tmp_path), 5))
    check_tensors(m, {"w": ((4, 3), "float32"), "b": ((3,), "bfloat16")})
    with pytest.raises(CheckpointError, match=r"tensor 'w' is float32 of global shape \(4, 3\), but it is loaded into float32 of global shape \(4, 4\)"):
        check_tensor(m, "w", (4, 4), "float32")
    with pytest.raises(CheckpointError, match=r"tensor 'b' is bfloat16 .* loaded into float16"):
        check_tensors(m, {"b": ((3,), "float16")})
    with pytest.raises(CheckpointError, match=r"has no tensor 'c'"):
        check_tensors(m, {"c": ((1,), "float32")})
    check_tensors(m, {"c": ((1,), "float32")}, strict=False)


def test_staging_dirs_are_never_complete_and_prune_removes_them(tmp_path: object) -> None:
    root = str(tmp_path)
    _save(root, 1)
    _save(root, 2)
    stale_with_manifest = _save(root, 3, commit_it=False)  # crashed between manifest and rename
    stale_empty = staging_dir(root, 4)  # crashed while writing files
    assert [s for s, _ in complete_checkpoints(root)] == [1, 2]
    assert newest_complete(root) == (2, os.path.join(root, "step-00000002"))
    removed = prune(root, keep=5)
    assert sorted(removed) == sorted([stale_with_manifest, stale_empty])
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]


def test_prune_keeps_the_newest(tmp_path: object) -> None:
    root = str(tmp_path)
    for step in (10, 2, 30, 4):
        _save(root, step)
    os.makedirs(os.path.join(root, "step-00000099"))  # no manifest: not complete, left alone
    assert prune(root, keep=2) == [os.path.join(root, "step-00000002"), os.path.join(root, "step-00000004")]
    assert [s for s, _ in complete_checkpoints(root)] == [10, 30]
    assert prune(root, keep=1) == [os.path.join(root, "step-00000010")]
    assert newest_complete(root) == (30, os.path.join(root, "step-00000030"))
    assert os.path.isdir(os.path.join(root, "step-00000099"))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            prune(root, keep=bad)  # type: ignore[arg-type]


def test_commit_replaces_same_step_and_checks_step(tmp_path: object) -> None:
    root = str(tmp_path)
    _save(root, 6, b"old")
    path = _save(root, 6, b"new-payload")
    assert verify_checkpoint(path).files["__0_0.distcp"].bytes == len(b"new-payload")
    assert sorted(os.listdir(root)) == ["step-00000006"]
    stage = _save(root, 8, commit_it=False)
    with pytest.raises(CheckpointError, match="its manifest is for step 8, not 9"):
        commit(stage, root, 9)
    renamed = os.path.join(root, "step-00000009")
    os.rename(stage, renamed)  # a directory renamed by hand does not pass as another step
    assert [s for s, _ in complete_checkpoints(root)] == [6]


def test_crash_between_the_two_renames_of_a_resave_keeps_the_old_step(tmp_path: object, monkeypatch: object) -> None:
    """A re-save of step N moves the old checkpoint aside, then renames the new one in; a crash
    between the two must leave step N loadable (the old copy), and a later prune keeps it."""
    root = str(tmp_path)
    _save(root, 5)
    _save(root, 6, b"old")
    stage = _save(root, 6, b"new-payload", commit_it=False)
    real_rename = os.rename
    calls = []

    def crash_on_second_rename(src: str, dst: str) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second_rename)  # type: ignore[attr-defined]
    with pytest.raises(KeyboardInterrupt):
        commit(stage, root, 6)
    monkeypatch.setattr(os, "rename", real_rename)  # type: ignore[attr-defined]
    assert not os.path.exists(os.path.join(root, "step-00000006"))
    step, path = newest_complete(root)  # type: ignore[misc]
    assert step == 6 and os.path.basename(path).startswith(".trash-step-00000006-")
    assert verify_checkpoint(path).files["__0_0.distcp"].bytes == len(b"old")
    removed = prune(root, keep=2)
    assert removed == [stage]  # the unfinished new copy goes, the old step 6 stays
    assert [s for s, _ in complete_checkpoints(root)] == [5, 6]
    again = _save(root, 6, b"newer")  # the next save of step 6 supersedes the moved-aside copy
    assert newest_complete(root) == (6, again)
    prune(root, keep=2)
    assert sorted(os.listdir(root)) == ["step-00000005", "step-00000006"]


def test_no_root_and_bad_arguments(tmp_path: object) -> None:
    missing = os.path.join(str(tmp_path), "nowhere")
    assert complete_checkpoints(missing) == [] and newest_complete(missing) is None
    with pytest.raises(CheckpointError, match="no such directory"):
        read_manifest(missing)
    with pytest.raises(ValueError, match="step must be an int"):
        staging_dir(str(tmp_path), -1)
    with pytest.raises(ValueError, match="nonce must be alphanumeric"):
        staging_dir(str(tmp_path), 1, nonce="../x")
    a = staging_dir(str(tmp_path), 1, nonce="abc")
    assert a == staging_dir(str(tmp_path), 1, nonce="abc")  # every rank of a save gets the same dir
