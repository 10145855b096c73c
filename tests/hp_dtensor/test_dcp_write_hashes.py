# mypy: disable-error-code="no-untyped-def"
"""The DCP write hashes every file as it writes it: the sizes and sha256s it returns must be
those of the files on disk (read back here), for every file in the directory, over seeded
generated state dicts on one process."""

from __future__ import annotations

import os
import random

import pytest
import torch

from hp_dtensor.checkpoint_manifest import file_entry
from hp_dtensor.platform.torch.dcp import write

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CASES = 6


def test_returned_hashes_are_the_files_on_disk(tmp_path) -> None:
    files = 0
    for case in range(CASES):
        rng = random.Random(case)
        state: dict = {
            f"w{i}": torch.randn(rng.randrange(1, 40), rng.randrange(1, 40)).to(
                rng.choice((torch.float32, torch.bfloat16, torch.int64)))
            for i in range(rng.randrange(1, 30))
        }
        state["meta"] = {"step": torch.tensor(case), "note": "x" * rng.randrange(0, 5000)}
        out = str(tmp_path / f"c{case}")
        written = write(state, out)
        assert sorted(written) == sorted(os.listdir(out)), (written, os.listdir(out))
        for rel, (n, sha) in written.items():
            on_disk = file_entry(os.path.join(out, rel))
            assert (on_disk.bytes, on_disk.sha256) == (n, sha), rel
            files += 1
    print(f"dcp write hashes: {CASES} state dicts, {files} files match their on-disk sha256")
