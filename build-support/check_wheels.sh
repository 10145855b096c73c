#!/usr/bin/env bash
# Builds the five wheels and proves the packages install on their own: in a fresh venv, hp-tp
# (with hp-dtensor's wheel beside it) installs and imports without hp_protocols or hp_models.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf dist
./pants package ::
count=$(ls dist/*.whl | wc -l)
[[ "${count}" -eq 5 ]] || { echo "FAIL: expected 5 wheels, got ${count}" >&2; ls dist >&2; exit 1; }
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "${venv}")"' EXIT
python3.11 -m venv "${venv}"
# torch==2.13.0 comes from the machine's pip find-links (the CPU wheel), like the lockfile.
"${venv}/bin/pip" install --quiet --find-links dist dist/hp_tp-*.whl
"${venv}/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util
import hp_tp
import hp_dtensor
installed = {d.metadata["Name"].lower() for d in md.distributions()}
assert {"hp-tp", "hp-dtensor"} <= installed, installed
for absent in ("hp_protocols", "hp_models", "hyper_parallel"):
    assert importlib.util.find_spec(absent) is None, f"{absent} was installed with hp-tp"
print("ok: hp-tp installs with hp-dtensor only:", sorted(n for n in installed if n.startswith("hp")))
PY
