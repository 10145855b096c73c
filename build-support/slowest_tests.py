"""Print the slowest test files of a ``./pants test --test-report`` run, from its JUnit XML reports.

Pants runs compatible files batched in one pytest process, so its own log gives a time per batch,
not per file.  pytest's JUnit report times every test case (setup, call and teardown: a module's
rank-pool start is part of its first case), and the sum over a file's cases is that file's share
of the run.  Usage: ``slowest_tests.py REPORT_DIR [COUNT]``; exits 0 even when the folder is empty
(a run that selected no tests), so it never fails CI by itself.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_file(classname: str) -> str:
    """``tests.hp_tp.test_x.TestY`` -> ``tests/hp_tp/test_x.py`` (the module is the last part
    that names a test file; classes nested below it are dropped)."""
    parts = classname.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].startswith("test_") or parts[i].endswith("_test"):
            return "/".join(parts[: i + 1]) + ".py"
    return "/".join(parts) + ".py"


def file_times(report_dir: Path) -> dict[str, tuple[float, int]]:
    """Seconds and case count per test file, over every report in ``report_dir``."""
    seconds: dict[str, float] = defaultdict(float)
    cases: dict[str, int] = defaultdict(int)
    for report in sorted(report_dir.rglob("*.xml")):
        for case in ET.parse(report).getroot().iter("testcase"):
            name = test_file(case.get("classname", "?"))
            seconds[name] += float(case.get("time", "0") or 0)
            cases[name] += 1
    return {name: (seconds[name], cases[name]) for name in seconds}


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    report_dir = Path(argv[0])
    count = int(argv[1]) if len(argv) == 2 else 10
    times = file_times(report_dir) if report_dir.is_dir() else {}
    if not times:
        print(f"no JUnit reports under {report_dir}")
        return 0
    total = sum(s for s, _ in times.values())
    print(f"slowest test files ({len(times)} files, {total:.0f}s of test time in all):")
    for name, (s, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:count]:
        print(f"{s:8.1f}s  {n:4d} cases  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
