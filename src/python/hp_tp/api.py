"""``parallelize_module``: apply styles to a module tree (semantics in docs/tensor-parallel.md)."""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

from hp_dtensor import DeviceMesh, get_current_mesh
from hp_dtensor.platform import current as _platform
from hp_tp import tied
from hp_tp.style import ParallelStyle


def parallelize_module(
    module: Any,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> Any:
    """Apply ``parallelize_plan`` to ``module`` on a 1-D ``device_mesh`` and return the module.

    * a ``ParallelStyle`` applies to ``module`` itself;
    * a ``dict`` maps FQNs to styles; each ``.``-separated atom is an ``fnmatch`` pattern matched
      against child names, so ``"layers.*.mlp.gate_proj"`` reaches every layer;
    * ``device_mesh=None`` uses the mesh of an enclosing ``with mesh:``.

    ``src_data_rank`` is written into every style before it is applied (0: parameters come from
    group-rank 0; ``None``: every rank slices its own copy without communication).
    """
    mesh = device_mesh if device_mesh is not None else get_current_mesh()
    if mesh is None:
        raise ValueError("parallelize_module needs a device_mesh, or must run inside `with mesh:`")
    if mesh.ndim > 1:
        raise ValueError(
            f"Tensor Parallel only accepts a 1D DeviceMesh, but got a {mesh.ndim}-D mesh {mesh}; "
            f"pass a 1-D slice such as device_mesh[\"tp\"]"
        )
    if parallelize_plan is None:
        warnings.warn(
            "parallelize_module got parallelize_plan=None: nothing is parallelized and the module is "
            "returned unchanged (automatic plans are not supported)",
            stacklevel=2,
        )
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan.apply(module, mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError(
            f"parallelize_plan must be a ParallelStyle or a dict[str, ParallelStyle], got "
            f"{type(parallelize_plan).__name__}"
        )
    for path, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_plan[{path!r}] must be a ParallelStyle, got {type(style).__name__}")
        if not isinstance(path, str):
            raise TypeError(f"parallelize_plan keys must be str FQNs, got {path!r}")
    for path, style in parallelize_plan.items():
        atoms = path.split(".")
        if path == "" or any(a == "" for a in atoms):
            raise ValueError(
                f"parallelize_plan key {path!r} is not a valid FQN: it has an empty atom; "
                f"use names like 'layers.*.mlp'"
            )
        matched = _apply_path(module, atoms, style, mesh, src_data_rank)
        if not matched:
            warnings.warn(
                f"parallelize_plan key {path!r} matched no submodule of {type(module).__name__}; it is skipped",
                stacklevel=2,
            )
    _check_ties_intact(module)
    return module


def _check_ties_intact(module: Any) -> None:
    """Warn when a parameter tied to one a style split is still held unsplit somewhere."""
    plat = _platform()
    held = [
        (f"{prefix}.{name}" if prefix else name, p)
        for prefix, m in plat.named_modules(module)
        for name, p in plat.direct_params(m)
        if p is not None and not isinstance(p, plat.DTensor)
    ]
    broken = tied.unsplit_ties(held)
    if broken:
        # A warning, not an error: a later parallelize_module call may still split that holder
        # (it then reuses the same DTensor parameter and the tie holds).
        warnings.warn(
            f"parallelize_module split a tied parameter but {', '.join(broken)} still holds the unsplit "
            f"original, which would train apart from its partner unless a later parallelize_module call "
            f"splits it the same way",
            stacklevel=3,
        )


def _apply_path(module: Any, atoms: list[str], style: ParallelStyle, mesh: DeviceMesh,
                src_data_rank: int | None) -> int:
    plat = _platform()
    head, rest = atoms[0], atoms[1:]
    matched = 0
    for name, child in list(plat.named_children(module)):
        if not fnmatch.fnmatchcase(name, head):
            continue
        if rest:
            matched += _apply_path(child, rest, style, mesh, src_data_rank)
        else:
            style.src_data_rank = src_data_rank
            new = style.apply(child, mesh)
            if new is not child and new is not None:
                setattr(module, name, new)
            matched += 1
    return matched
