#!/usr/bin/env bash
# Builds the wheels and proves each package installs on its own, its framework from an extra:
#   1. every wheel's Requires-Dist lists exactly its allowed first-party edges as ~= ranges, and no
#      framework, numpy bound or exact pin outside an extra (check_wheel_metadata.py);
#   2. hp-tp + hp-dtensor[torch] in a fresh venv that already holds numpy 2: torch comes in,
#      mindspore does not, numpy is untouched, and a 2-rank TP MLP under torchrun (gloo) matches
#      one process;
#   3. hp-fsdp + hp-dtensor[torch] alone in a fresh venv: a 2-rank fully_shard MLP under torchrun
#      matches one process after 3 AdamW steps;
#   4. hp-checkpoint + hp-dtensor[torch] alone in a fresh venv: a 2-rank state dict saved in one
#      layout loads into three others, in both formats, and a damaged file is refused;
#   5. hp-cp + hp-dtensor[torch] alone in a fresh venv: 2-rank ring attention matches SDPA on the
#      whole sequence;
#   6. hp-pp + hp-dtensor[torch] alone in a fresh venv: a 2-rank pipeline (1F1B and interleaved
#      1F1B) of an MLP matches one process, loss and gradients;
#   7. hp-protocols + hp-tp + hp-dtensor[mindspore] in a fresh venv (what MindFormers installs): no
#      torch, MindSpore is the platform, a JobConfig resolves into a mesh and a DTensor, and a
#      protocol decoder trains with loss_parallel on 2 mccl ranks.
# torch is constrained to the CPU wheel on disk (an unconstrained torch is a multi-GB CUDA build).
# MindSpore (~800 MB) is kept in a wheel cache (HP_WHEEL_CACHE) and reused from Pants' own
# download of the mindspore resolve when there is one, so it is fetched at most once per machine.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

TORCH_VERSION="2.13.0"
TORCH_FIND_LINKS="${TORCH_FIND_LINKS:-/opt/wheels}"
MINDSPORE_VERSION="2.10.0"
cache="${HP_WHEEL_CACHE:-${XDG_CACHE_HOME:-${HOME}/.cache}/hyper-parallel/wheels}"
# No bytecode at install time: compiling all of torch and MindSpore costs about 12 s of CPU per venv,
# while the examples import a small part of them (compiled on first import instead).
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_COMPILE=1

fail() { echo "FAIL: $*" >&2; exit 1; }
stage() { echo "-- $* (at ${SECONDS}s)"; }

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

stage "building the wheels"
rm -rf dist
./pants --filter-target-type=python_distribution package ::
wheels=(dist/*.whl)
[[ "${#wheels[@]}" -eq 10 ]] || { ls dist >&2; fail "expected 10 wheels, got ${#wheels[@]}"; }
whl() { local f=(dist/"$1"-*.whl); echo "${root}/${f[0]}"; }

stage "wheel metadata"
python3.11 build-support/check_wheel_metadata.py dist

stage "hp-tp + hp-dtensor[torch]"
ls "${TORCH_FIND_LINKS}"/torch-"${TORCH_VERSION}"*.whl >/dev/null 2>&1 \
  || fail "no torch-${TORCH_VERSION} wheel in ${TORCH_FIND_LINKS} (set TORCH_FIND_LINKS to the folder with the CPU wheel)"
echo "torch==${TORCH_VERSION}" > "${work}/torch-constraint.txt"
python3.11 -m venv "${work}/torch"
tpip() { "${work}/torch/bin/pip" install --quiet "$@"; }
tpip "numpy>=2"
numpy_before="$("${work}/torch/bin/python" -c 'import numpy; print(numpy.__version__)')"
tpip --find-links "file://${TORCH_FIND_LINKS}" --find-links "${root}/dist" -c "${work}/torch-constraint.txt" \
  "$(whl hp_tp)" "$(whl hp_dtensor)[torch]"
"${work}/torch/bin/python" - "${numpy_before}" <<'PY'
import importlib.metadata as md
import sys

import hp_tp
installed = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
first_party = sorted(n for n in installed if n.startswith("hp-") or n == "hyper-parallel")
assert first_party == ["hp-dtensor", "hp-tp"], first_party
assert "mindspore" not in installed, "hp-dtensor[torch] pulled mindspore"
assert installed["numpy"] == sys.argv[1], f"numpy moved from {sys.argv[1]} to {installed['numpy']}"
assert installed["torch"].endswith("+cpu"), installed["torch"]
assert "site-packages" in hp_tp.__file__, hp_tp.__file__
print(f"ok: installed {first_party} with torch {installed['torch']}; no mindspore; numpy {installed['numpy']} untouched")
PY
(cd "${work}" && timeout 300 "${work}/torch/bin/torchrun" --standalone --nproc-per-node 2 \
  "${root}/build-support/wheel_examples/tp_mlp.py" 2>&1 | grep -v -e '\*\*\*\*\*' -e OMP_NUM_THREADS -e '^W[0-9].*distributed/run.py') \
  || fail "the 2-rank TP example failed"

# The venvs after the first are made without pip of their own (bootstrapping pip into a venv
# took about 4 s each); the first venv's pip installs into them (pip --python).
vpip() { local venv="$1"; shift; "${work}/torch/bin/pip" --python "${venv}/bin/python" "$@"; }

# wheel_alone VENV EXPECTED WHAT EXAMPLE [EXAMPLE_ARG...] -- REQUIREMENT...
# Installs the requirements alone in the fresh venv ${work}/VENV (torch, which every requirement
# list pulls in through hp-dtensor[torch], is linked in from the first venv rather than unpacked
# again: seed_venv.py), checks that exactly the
# first-party distributions EXPECTED (comma-separated, sorted) and no MindSpore came in, then runs
# the 2-rank wheel_examples/EXAMPLE under torchrun from outside the source tree.
wheel_alone() {
  local venv="${work}/$1" expected="$2" what="$3" example="$4"
  shift 4
  local example_args=()
  while [[ "$1" != "--" ]]; do example_args+=("$1"); shift; done
  shift
  stage "${expected//,/ + } alone"
  python3.11 -m venv --without-pip "${venv}"
  "${work}/torch/bin/python" "${root}/build-support/seed_venv.py" torch "${venv}"
  vpip "${venv}" install --quiet --find-links "file://${TORCH_FIND_LINKS}" --find-links "${root}/dist" \
    -c "${work}/torch-constraint.txt" "$@"
  "${venv}/bin/python" - "${expected}" <<'PY'
import importlib.metadata as md
import sys

installed = {d.metadata["Name"].lower() for d in md.distributions()}
first_party = sorted(n for n in installed if n.startswith("hp-") or n == "hyper-parallel")
assert first_party == sys.argv[1].split(","), first_party
assert "mindspore" not in installed, "a torch install pulled mindspore"
print(f"ok: installed {first_party} alone")
PY
  (cd "${work}" && timeout 300 "${venv}/bin/torchrun" --standalone --nproc-per-node 2 \
    "${root}/build-support/wheel_examples/${example}" "${example_args[@]}" 2>&1 \
    | grep -v -e '\*\*\*\*\*' -e OMP_NUM_THREADS -e '^W[0-9].*distributed/run.py') \
    || fail "the 2-rank ${what} example failed"
}

wheel_alone fsdp hp-dtensor,hp-fsdp "fully_shard" fsdp_mlp.py -- "$(whl hp_fsdp)" "$(whl hp_dtensor)[torch]"
wheel_alone ckpt hp-checkpoint,hp-dtensor "checkpoint reshard" checkpoint_reshard.py "${work}/ckpt-out" -- \
  "$(whl hp_checkpoint)[torch]" "$(whl hp_dtensor)[torch]"
wheel_alone cp hp-cp,hp-dtensor "ring attention" cp_ring.py -- "$(whl hp_cp)" "$(whl hp_dtensor)[torch]"
wheel_alone pp hp-dtensor,hp-pp "pipeline" pp_mlp.py -- "$(whl hp_pp)" "$(whl hp_dtensor)[torch]"

stage "hp-protocols + hp-tp + hp-dtensor[mindspore]"
mkdir -p "${cache}"
if ! ls "${cache}"/mindspore-"${MINDSPORE_VERSION}"-*.whl >/dev/null 2>&1; then
  # Pants downloads the same wheel for the mindspore resolve; copy it rather than fetch it again.
  found="$(find "${HOME}/.cache/pants/named_caches/pex_root" "${HOME}/.pex" -type f -path '*downloads*' \
    -name "mindspore-${MINDSPORE_VERSION}-cp311-*.whl" 2>/dev/null | head -n 1 || true)"
  if [[ -n "${found}" ]]; then cp "${found}" "${cache}/"; fi
fi
python3.11 -m venv --without-pip "${work}/ms"
ms_install() {
  vpip "${work}/ms" install --quiet --no-index --find-links "${cache}" --find-links "${root}/dist" \
    "$(whl hp_protocols)" "$(whl hp_tp)" "$(whl hp_dtensor)[mindspore]"
}
# The venv installs from the cache and the local wheels only; when the cache lacks something, it is
# filled first (files already there are not downloaded again).
if ! ms_install 2>/dev/null; then
  "${work}/torch/bin/pip" download --quiet -d "${cache}" --find-links "${cache}" --find-links "${root}/dist" \
    "$(whl hp_protocols)" "$(whl hp_tp)" "$(whl hp_dtensor)[mindspore]"
  rm -f "${cache}"/hp_*.whl "${cache}"/hyper_parallel-*.whl
  ms_install
fi
"${work}/ms/bin/python" - <<'PY'
import importlib.metadata as md
installed = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
first_party = sorted(n for n in installed if n.startswith("hp-") or n == "hyper-parallel")
assert first_party == ["hp-dtensor", "hp-protocols", "hp-tp"], first_party
assert "torch" not in installed, "hp-dtensor[mindspore] pulled torch"
print(f"ok: installed {first_party} with mindspore {installed['mindspore']}, numpy {installed['numpy']}; no torch")
PY
(cd "${work}" && GLOG_v=3 timeout 300 "${work}/ms/bin/python" "${root}/build-support/wheel_examples/ms_job.py") \
  || fail "the MindSpore JobConfig example failed"
# The MindFormers-shaped consumer from these wheels alone: a protocol decoder on 2 mccl ranks
# equals one process (its helpers are imported from the test folder, hp_* from site-packages).
(cd "${root}/tests/hp_protocols/mindspore" && HYPER_PARALLEL_PLATFORM=mindspore GLOG_v=3 \
  timeout 600 "${work}/ms/bin/python" consumer_main.py) \
  || fail "the MindSpore consumer (protocol decoder on 2 mccl ranks) failed from the wheels"
echo "ok: the wheels install alone (${SECONDS}s)"
