"""This process's communication state on MindSpore, shared by process groups and collectives.

Kept apart from ``process_group`` (which issues a last collective when it leaves the job) so that
``collectives`` can read the device and the world group without importing ``process_group``.
"""

from __future__ import annotations

from typing import Any

# initialized: joined a job (or became a world of one); single: a world of one, no collectives;
# device: the MindSpore device target the process runs on.
_state: dict[str, Any] = {"initialized": False, "single": False, "device": "CPU"}


def device_target() -> str:
    """"CPU" or "Ascend": decides whether composed (CPU) or native (Ascend) collectives run."""
    return str(_state["device"])


def world_group() -> str:
    from mindspore.communication import GlobalComm

    return str(GlobalComm.WORLD_COMM_GROUP)
