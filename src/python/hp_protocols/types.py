"""Mesh axis names shared by configs, sharding declarations and meshes."""

from __future__ import annotations

from enum import StrEnum


class MeshAxisName(StrEnum):
    """Names of mesh dims; the literals are the mesh dim names hyper-parallel's meshes use."""

    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    FSDP = "fsdp"
    TP = "tp"
    CP = "cp"
    PP = "pp"
    EP = "ep"
    EFSDP = "efsdp"
