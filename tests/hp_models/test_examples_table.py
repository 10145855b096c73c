"""examples/README.md's table stays true: every job file in examples/ has a row, and each row's
command, checked by the trainer as it is run (no ranks start), trains as the row says."""

from __future__ import annotations

import shlex
from pathlib import Path

from hp_models import train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _rows() -> list[tuple[str, str, str]]:
    """(example file, "trains as", command) of each table row."""
    rows = []
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[4].startswith("`./pants run"):
            rows.append((cells[1].split("](")[1].rstrip(")"), cells[2], cells[4].strip("`")))
    return rows


def test_every_example_has_a_row_whose_command_trains_as_it_says(tmp_path: Path) -> None:
    rows = _rows()
    assert sorted(r[0] for r in rows) == sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    for example, trains_as, command in rows:
        words = shlex.split(command)
        assert words[:4] == ["./pants", "run", "src/python/hp_models:train", "--"], command
        args = train.parse_args([*words[4:], "--out-dir", str(tmp_path / example)])
        assert args.job == f"examples/{example}"
        args.job = str(EXAMPLES / example)
        _, layout = train.check_args(args)
        assert layout.describe() == trains_as, (example, layout.describe())
    print(f"\n{len(rows)} example rows checked")
