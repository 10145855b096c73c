#!/usr/bin/env bash
# Proves the promise "Pants runs only the tests a change affects" on the list of targets, not on
# timing: in a scratch worktree of HEAD, a one-line change to one package must make
#   pants --changed-since=HEAD --changed-dependents=transitive --filter-target-type=python_test list
# select exactly the test files of that package and of the code that imports it, for a sample
# change in every package (and in each backend of the platform layer).
# This checkout is never modified: the edits happen in the scratch worktree, which is removed on
# exit, error or interrupt.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

# changed file -> the test folders it must select (every python_test under each, and nothing else)
samples=(
  "src/python/hp_dtensor/__init__.py|tests/hp_dtensor tests/hp_dtensor/mindspore tests/hp_tp tests/hp_tp/mindspore tests/hp_protocols tests/hp_models tests/hyper_parallel"
  "src/python/hp_dtensor/platform/torch/__init__.py|tests/hp_dtensor tests/hp_dtensor/mindspore tests/hp_tp tests/hp_tp/mindspore tests/hp_protocols tests/hp_models tests/hyper_parallel"
  "src/python/hp_dtensor/platform/mindspore/__init__.py|tests/hp_dtensor/mindspore tests/hp_tp/mindspore"
  "src/python/hp_tp/__init__.py|tests/hp_tp tests/hp_tp/mindspore tests/hp_models tests/hyper_parallel"
  "src/python/hp_protocols/__init__.py|tests/hp_protocols tests/hp_models"
  "src/python/hp_models/__init__.py|tests/hp_models"
  # The MindSpore TP tests import the styles through the umbrella package.
  "src/python/hyper_parallel/__init__.py|tests/hyper_parallel tests/hp_tp/mindspore"
)

scratch_parent="$(mktemp -d)"
scratch="${scratch_parent}/tree"
cleanup() {
  # The scratch tree's own pantsd (started by the queries below) goes with the tree.
  local pidfile pid
  for pidfile in "${scratch}"/.pids/*/pantsd/pid; do
    [[ -f "${pidfile}" ]] || continue
    pid="$(cat "${pidfile}")"
    [[ -n "${pid}" ]] && kill "${pid}" 2>/dev/null || true
  done
  git -C "${root}" worktree remove --force "${scratch}" >/dev/null 2>&1 || true
  rm -rf "${scratch_parent}"
  git -C "${root}" worktree prune
}
trap cleanup EXIT
trap 'exit 130' INT TERM

git worktree add --quiet --detach "${scratch}" HEAD
# Reuse this checkout's bootstrapped Pants (ignored files do not come with a worktree).
[[ -d .pants-bootstrap ]] && ln -s "${root}/.pants-bootstrap" "${scratch}/.pants-bootstrap"
cd "${scratch}"
log="${scratch_parent}/pants.log"
pants() {
  ./pants --no-dynamic-ui "$@" 2>>"${log}" || { echo "FAIL: ./pants $*" >&2; tail -n 30 "${log}" >&2; exit 1; }
}

all_tests="$(pants --filter-target-type=python_test list ::)"
[[ -n "${all_tests}" ]] || { echo "FAIL: no python_test targets found" >&2; exit 1; }
folder_of() { sed -E 's#/[^/]*:[^/]*$##'; }  # tests/hp_tp/test_x.py:tests -> tests/hp_tp

failed=0
for sample in "${samples[@]}"; do
  file="${sample%%|*}"
  folders="${sample#*|}"
  [[ -f "${file}" ]] || { echo "FAIL: sample file ${file} does not exist" >&2; exit 1; }
  echo "# affected-test probe" >> "${file}"
  selected="$(pants --changed-since=HEAD --changed-dependents=transitive --filter-target-type=python_test list | sort)"
  git checkout --quiet -- "${file}"
  expected="$(for t in ${all_tests}; do
    f="$(folder_of <<<"${t}")"
    for want in ${folders}; do [[ "${f}" == "${want}" ]] && echo "${t}"; done
  done | sort)"
  got_folders="$(folder_of <<<"${selected}" | sort | uniq -c | awk '{printf "%s(%s) ", $2, $1}')"
  if [[ "${selected}" == "${expected}" ]]; then
    echo "ok: ${file} -> $(wc -l <<<"${selected}") test files: ${got_folders}"
  else
    failed=1
    echo "FAIL: ${file} selected: ${got_folders}" >&2
    echo "  expected every test file in: ${folders}" >&2
    diff <(echo "${expected}") <(echo "${selected}") | sed 's/^/  /' >&2 || true
  fi
done
[[ -z "$(git status --porcelain --untracked-files=no)" ]] || { echo "FAIL: the scratch tree was left modified" >&2; exit 1; }
exit "${failed}"
