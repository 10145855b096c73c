#!/usr/bin/env bash
# Installs hp-protocols and hp-dtensor from their wheels the way a MindSpore consumer (MindFormers)
# would -- a fresh venv with MindSpore and without torch -- and runs the consumer check there: a
# protocol decoder block on 2 mccl ranks equals one process.  Pass --no-build to reuse dist/.
# MindSpore's ~800 MB wheel comes from pip's find-links / cache (HP_WHEEL_CACHE), not the network.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--no-build" ]]; then
  rm -f dist/hp_dtensor-*.whl dist/hp_protocols-*.whl
  ./pants package src/python/hp_dtensor:dist src/python/hp_protocols:dist
fi
dtensor=$(ls dist/hp_dtensor-*.whl)
protocols=$(ls dist/hp_protocols-*.whl)
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "${venv}")"' EXIT
python3.11 -m venv "${venv}"
pip=("${venv}/bin/pip" install --quiet --find-links "${HP_WHEEL_CACHE:-${HOME}/.cache/hyper-parallel/wheels}")
if unzip -p "${dtensor}" '*.dist-info/METADATA' | grep -qx 'Provides-Extra: mindspore'; then
  # Wheels with framework extras: the consumer's one-line install.
  "${pip[@]}" "${dtensor}[mindspore]" "${protocols}" pyyaml
else
  # Wheels whose hp-dtensor requires torch outright: install the framework by hand and the wheels
  # without their dependencies (what a MindSpore user must do until the extras exist).
  "${pip[@]}" "mindspore==2.10.0" "numpy>=1.26,<2" pyyaml safetensors
  "${pip[@]}" --no-deps "${dtensor}" "${protocols}"
fi
"${venv}/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is not None)' \
  || { echo "FAIL: torch was installed into the MindSpore consumer's venv" >&2; exit 1; }
cd tests/hp_protocols/mindspore
HYPER_PARALLEL_PLATFORM=mindspore GLOG_v=3 "${venv}/bin/python" consumer_main.py
