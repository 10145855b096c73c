"""How a protocol Module declares its sharding: per mesh-axis placements by name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hp_dtensor.placement_types import Placement, Replicate
from hp_protocols.types import MeshAxisName

NamedPlacement = dict[MeshAxisName | str, Placement]


@dataclass(kw_only=True, slots=True)
class LocalMapConfig:
    """Run a module's forward on local tensors (declared; not implemented yet)."""

    in_placements: dict[str, NamedPlacement] = field(default_factory=dict)
    out_placements: dict[str, NamedPlacement] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """Sharding of one module.

    ``state_shardings``: parameter/buffer path -> placements (params become DTensors).
    ``in_src_shardings`` / ``in_dst_shardings``: forward argument name -> how it arrives / what
    forward needs (a plain tensor arriving is annotated with its src placement, default the dst).
    ``out_src_shardings`` / ``out_dst_shardings``: output name ("output", or "output0", ... for a
    tuple) -> how forward produces it / what callers get.
    """

    state_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    in_src_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    in_dst_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    out_src_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    out_dst_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    local_map: LocalMapConfig | None = None


def resolve_placements(named: NamedPlacement, mesh_axis_names: Sequence[str] | None) -> list[Placement]:
    """Placements in the mesh's dim order; axes the declaration leaves out are Replicate.

    Raises ``ValueError`` when the declaration names an axis the mesh does not have."""
    if mesh_axis_names is None:
        raise ValueError("resolve_placements needs a mesh with mesh_dim_names (e.g. ('tp',))")
    names = [str(n) for n in mesh_axis_names]
    keys = {str(k) for k in named}
    extra = sorted(keys - set(names))
    if extra:
        raise ValueError(f"NamedPlacement has axes not in mesh: {extra}; mesh axes are {names}")
    by_name = {str(k): v for k, v in named.items()}
    return [by_name.get(n, Replicate()) for n in names]
