"""Exchanging small integer records over a whole mesh, framework-neutral.

How ranks compare what they hold before trusting each other's tensors (``from_local``'s
``run_check``, the RNG's agreed seed): every rank contributes rows of ints and every rank gets
everyone's rows.  The backend's ``Collectives.gather_int_rows`` moves them along one mesh dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hp_dtensor.backend_contract import Collectives
    from hp_dtensor.device_mesh import DeviceMesh


def gather_over_mesh(rows: list[list[int]], mesh: DeviceMesh, prims: Collectives) -> list[list[int]]:
    """Every rank's ``rows`` (each rank the same number of rows of the same width), in the mesh's
    row-major rank order, on every rank.  Gathers along the last mesh dim first, so rows come
    out ordered by mesh coordinate; exact for any int64 values."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not part of {mesh}")
    for k in reversed(range(mesh.ndim)):
        if mesh.shape[k] > 1:
            rows = prims.gather_int_rows(rows, mesh.get_group(k), mesh.shape[k], coord[k])
    return rows
