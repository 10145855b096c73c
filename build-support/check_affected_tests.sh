#!/usr/bin/env bash
# Proves the promise "Pants runs only the tests a change affects" on the list of targets, not on
# timing: a one-line change to one package must make
#   pants --changed-since=HEAD --changed-dependents=transitive --filter-target-type=python_test list
# select exactly the test files of that package and of the code that imports it, for a sample
# change in every package (and in each backend of the platform layer).
# The probe line is appended to one committed file at a time and removed right after the query;
# a trap restores the file on exit, error or interrupt. Because any other change would be selected
# too, the check refuses to run on a checkout with uncommitted changes (CI's clean clone has none).
set -euo pipefail
cd "$(dirname "$0")/.."

# changed file -> the test folders it must select (every python_test under each, and nothing else;
# "!path/test_x.py" excepts one file of a listed folder that does not import the changed package)
ALL="tests/hp_dtensor tests/hp_dtensor/mindspore tests/hp_fsdp tests/hp_fsdp/mindspore tests/hp_tp tests/hp_tp/mindspore tests/hp_checkpoint tests/hp_checkpoint/mindspore tests/hp_cp tests/hp_pp tests/hp_ep tests/hp_protocols tests/hp_protocols/mindspore tests/hp_models tests/hp_models/mindspore tests/hyper_parallel tests/hyper_parallel/mindspore"
samples=(
  "src/python/hp_dtensor/__init__.py|${ALL}"
  "src/python/hp_dtensor/platform/torch/__init__.py|${ALL}"
  "src/python/hp_dtensor/platform/mindspore/__init__.py|tests/hp_dtensor/mindspore tests/hp_checkpoint/mindspore tests/hp_fsdp/mindspore tests/hp_protocols/mindspore tests/hp_tp/mindspore tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_tp/__init__.py|tests/hp_ep tests/hp_fsdp !tests/hp_fsdp/test_clip_grad.py tests/hp_fsdp/mindspore tests/hp_tp tests/hp_tp/mindspore tests/hp_protocols/mindspore tests/hp_models tests/hyper_parallel tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  # A package's framework code is its own: a fix there selects that package's tests and its
  # dependents' (the umbrella's MindSpore tests import hp_fsdp through hyper_parallel).
  "src/python/hp_tp/platform/torch/loss_parallel.py|tests/hp_ep tests/hp_fsdp !tests/hp_fsdp/test_clip_grad.py tests/hp_fsdp/mindspore tests/hp_tp tests/hp_tp/mindspore tests/hp_protocols/mindspore tests/hp_models tests/hyper_parallel tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_fsdp/__init__.py|tests/hp_ep tests/hp_fsdp tests/hp_fsdp/mindspore tests/hp_models tests/hyper_parallel !tests/hyper_parallel/test_moved_paths.py tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_fsdp/platform/torch/fsdp.py|tests/hp_ep tests/hp_fsdp tests/hp_fsdp/mindspore tests/hp_models tests/hyper_parallel !tests/hyper_parallel/test_moved_paths.py tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_checkpoint/__init__.py|tests/hp_ep tests/hp_checkpoint tests/hp_checkpoint/mindspore tests/hp_models tests/hyper_parallel !tests/hyper_parallel/test_reexports.py tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_checkpoint/platform/torch/dcp.py|tests/hp_ep tests/hp_checkpoint tests/hp_checkpoint/mindspore tests/hp_models tests/hyper_parallel !tests/hyper_parallel/test_reexports.py tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_protocols/__init__.py|tests/hp_ep tests/hp_protocols tests/hp_protocols/mindspore tests/hp_models tests/hyper_parallel !tests/hyper_parallel/test_fsdp_checkpoint_reshard.py !tests/hyper_parallel/test_reexports.py tests/hp_models/mindspore"
  # The new parallelisms: their tests and the model code built on them, nothing of each other.
  "src/python/hp_pp/__init__.py|tests/hp_pp tests/hp_models tests/hp_ep tests/hyper_parallel !tests/hyper_parallel/test_fsdp_checkpoint_reshard.py !tests/hyper_parallel/test_moved_paths.py tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_cp/platform/torch/ring.py|tests/hp_cp tests/hp_models tests/hp_ep tests/hp_models/mindspore"
  "src/python/hp_ep/__init__.py|tests/hp_ep tests/hp_models tests/hyper_parallel !tests/hyper_parallel/test_fsdp_checkpoint_reshard.py !tests/hyper_parallel/test_moved_paths.py tests/hyper_parallel/mindspore tests/hp_models/mindspore"
  "src/python/hp_models/__init__.py|tests/hp_ep tests/hp_models tests/hp_models/mindspore"
  "src/python/hyper_parallel/__init__.py|tests/hyper_parallel !tests/hyper_parallel/test_fsdp_checkpoint_reshard.py !tests/hyper_parallel/test_moved_paths.py tests/hyper_parallel/mindspore"
)

if [[ -n "$(git status --porcelain)" ]]; then
  echo "FAIL: uncommitted changes would be selected with the probes; commit or stash them first:" >&2
  git status --short >&2
  exit 1
fi

probed=""
restore() { if [[ -n "${probed}" ]]; then git checkout --quiet -- "${probed}"; probed=""; fi; return 0; }
trap restore EXIT
trap 'exit 130' INT TERM

log="$(mktemp)"
pants() {
  ./pants --no-dynamic-ui "$@" 2>"${log}" || { echo "FAIL: ./pants $*" >&2; tail -n 30 "${log}" >&2; exit 1; }
}

all_tests="$(pants --filter-target-type=python_test list ::)"
[[ -n "${all_tests}" ]] || { echo "FAIL: no python_test targets found" >&2; exit 1; }
folder_of() { sed -E 's#/[^/]*:[^/]*$##'; }  # tests/hp_tp/test_x.py:tests -> tests/hp_tp

failed=0
for sample in "${samples[@]}"; do
  file="${sample%%|*}"
  folders="${sample#*|}"
  [[ -f "${file}" ]] || { echo "FAIL: sample file ${file} does not exist" >&2; exit 1; }
  probed="${file}"
  echo "# affected-test probe" >> "${file}"
  selected="$(pants --changed-since=HEAD --changed-dependents=transitive --filter-target-type=python_test list | sort)"
  restore
  expected="$(for t in ${all_tests}; do
    f="$(folder_of <<<"${t}")"
    [[ " ${folders} " == *" !${t%%:*} "* ]] && continue  # a file the folder entry excepts
    for want in ${folders}; do if [[ "${f}" == "${want}" ]]; then echo "${t}"; fi; done
  done | sort)"
  got_folders="$(folder_of <<<"${selected}" | sort | uniq -c | awk '{printf "%s (%s) ", $2, $1}')"
  if [[ -n "${selected}" && "${selected}" == "${expected}" ]]; then
    echo "ok: ${file} -> $(wc -l <<<"${selected}") test files: ${got_folders}"
  else
    failed=1
    echo "FAIL: ${file} selected: ${got_folders:-nothing}" >&2
    echo "  expected every test file in: ${folders}" >&2
    diff <(echo "${expected}") <(echo "${selected}") | sed 's/^/  /' >&2 || true
  fi
done
rm -f "${log}"
[[ -z "$(git status --porcelain)" ]] || { echo "FAIL: the checkout was left modified" >&2; exit 1; }
exit "${failed}"
