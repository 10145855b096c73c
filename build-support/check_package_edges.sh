#!/usr/bin/env bash
# Proves the package-edge rules (docs/architecture.md) are enforced: every forbidden import below must make
# `pants dependencies` fail, an allowed one must pass, and the tree must pass.  The same goes for
# framework imports: torch and mindspore are imported only inside a package's own platform/<framework>/
# folder (hp_models, model code, excepted), and neutral code never reaches into any platform folder.
# Probe files are written into the tree and always removed.
set -euo pipefail
cd "$(dirname "$0")/.."

probe_name="_edge_probe_$$.py"
probes=()
cleanup() { for f in "${probes[@]:-}"; do [[ -n "$f" ]] && rm -f "$f"; done; }
trap cleanup EXIT

check() {  # check deny <from_pkg> <import_module>: one `pants dependencies` run per probe, since
  # Pants stops at the first violation it finds
  local expect="$1" from="$2" mod="$3" file="src/python/$2/${probe_name}"
  [[ "${expect}" == deny ]] || { allowed+=("${from}|${mod}"); return 0; }
  echo "import ${mod}  # noqa: F401" > "${file}"
  probes+=("${file}")
  local out rc=0
  out="$(./pants dependencies "${file}" 2>&1)" || rc=$?
  rm -f "${file}"
  if [[ ${rc} -eq 0 ]] || ! grep -q "DependencyRuleActionDeniedError" <<<"${out}"; then
    echo "FAIL: ${from} -> ${mod} was not rejected" >&2; echo "${out}" >&2; exit 1
  fi
  echo "ok: ${from} -> ${mod} rejected"
}

# Allowed edges are probed all at once, together with the whole tree: one `pants dependencies ::`
# with every allowed probe in place must pass.  Each probe is a file of its own in its folder.
allowed=()
check_allowed() {
  local entry from mod file i=0 out rc=0
  for entry in "${allowed[@]}"; do
    from="${entry%%|*}" mod="${entry#*|}" file="src/python/${from}/_edge_probe_$$_${i}.py"
    echo "import ${mod}  # noqa: F401" > "${file}"
    probes+=("${file}")
    i=$((i + 1))
  done
  out="$(./pants dependencies :: 2>&1)" || rc=$?
  cleanup
  if [[ ${rc} -ne 0 ]]; then
    echo "FAIL: an allowed edge or the tree itself was rejected:" >&2; echo "${out}" >&2; exit 1
  fi
  for entry in "${allowed[@]}"; do echo "ok: ${entry%%|*} -> ${entry#*|} allowed"; done
  echo "ok: the tree has no forbidden edge"
}

check deny hp_dtensor hp_tp
check deny hp_dtensor hp_protocols
check deny hp_tp hp_protocols
check deny hp_tp hp_models
check deny hp_protocols hp_tp
check deny hp_fsdp hp_tp
check deny hp_tp hp_fsdp
check deny hp_dtensor hp_fsdp
check deny hp_protocols hyper_parallel
check deny hp_models hyper_parallel
check deny hp_dtensor hp_checkpoint
check deny hp_tp hp_checkpoint
check deny hp_fsdp hp_checkpoint
check deny hp_protocols hp_checkpoint
check deny hp_checkpoint hp_tp
check deny hp_checkpoint hp_fsdp
check deny hp_checkpoint hp_protocols
check deny hp_cp hp_fsdp
check deny hp_cp hp_protocols
check deny hp_cp hp_models
check deny hp_dtensor hp_cp
check deny hp_tp hp_cp
check deny hp_fsdp hp_cp
check deny hp_pp hp_tp
check deny hp_pp hp_fsdp
check deny hp_pp hp_protocols
check deny hp_pp hp_models
check deny hp_dtensor hp_pp
check deny hp_tp hp_pp
check deny hp_ep hp_fsdp
check deny hp_ep hp_models
check deny hp_tp hp_ep
check deny hp_dtensor hp_ep
# frameworks only under platform/<framework>/
check deny hp_dtensor torch
check deny hp_dtensor mindspore
check deny hp_dtensor/sharding torch
check deny hp_dtensor/api torch
check deny hp_dtensor/sharding mindspore
check deny hp_tp torch
check deny hp_fsdp torch
check deny hp_checkpoint torch
check deny hp_checkpoint mindspore
check deny hp_protocols torch
check deny hp_protocols mindspore
check deny hp_cp torch
check deny hp_cp/platform/torch mindspore
check deny hp_cp hp_dtensor.platform.torch.collectives
check deny hp_pp torch
check deny hp_pp hp_dtensor.platform.torch.collectives
check deny hp_fsdp/platform/torch mindspore
check deny hp_ep torch
check deny hp_ep/platform/torch mindspore
check deny hp_tp/platform/mindspore hp_tp.platform.torch.loss_parallel
check deny hp_fsdp hp_dtensor.platform.torch.collectives
check deny hp_checkpoint hp_dtensor.platform.mindspore.collectives
check allow hp_fsdp/platform/torch torch
check allow hp_checkpoint/platform/torch torch
check allow hp_tp/platform/mindspore mindspore
check allow hp_dtensor/platform/torch torch
check allow hp_fsdp/platform/torch hp_dtensor.platform.torch.collectives
check allow hp_models torch
check allow hp_tp hp_dtensor
check allow hp_models hp_tp
check allow hp_fsdp hp_dtensor
check allow hp_models hp_fsdp
check allow hp_checkpoint hp_dtensor
check allow hp_models hp_checkpoint
check allow hp_cp hp_dtensor
check allow hp_cp/platform/torch torch
check allow hp_cp/platform/torch hp_dtensor.platform.torch.collectives
check allow hp_pp hp_dtensor
check allow hp_pp/platform/torch torch
check allow hp_models hp_pp
check allow hp_ep hp_dtensor
check allow hp_ep hp_tp
check allow hp_ep/platform/torch torch
check allow hp_models hp_ep
check_allowed
