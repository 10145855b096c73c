"""The actions a pipeline plan is made of: compute (F, B, or B split into I and W) and P2P.

An action names a microbatch ``m`` and a virtual stage ``v``: ``F`` runs stage ``v``'s forward on
microbatch ``m``; ``B`` its full backward; ``I`` only the gradient of its input (what the previous
stage waits for) and ``W`` the gradient of its weights (which nothing waits for).  ``SEND_F`` /
``RECV_F`` move the activation stage ``v`` produced to stage ``v + 1`` (a ``RECV_F`` names the
stage that receives, ``v``, and its peer is the rank of ``v - 1``); ``SEND_B`` / ``RECV_B`` move
the gradient of stage ``v``'s input back to stage ``v - 1`` likewise.  Pure: no framework.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ActionKind(enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (the input-gradient half of a backward)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on microbatch ``microbatch`` of virtual stage ``stage``;
    ``peer`` is the pp rank on the other end of a SEND/RECV (None for compute)."""

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        base = f"{self.kind.value}{self.microbatch}@v{self.stage}"
        if self.peer is None:
            return base
        arrow = "->" if self.kind.is_send else "<-"
        return f"{base}{arrow}pp{self.peer}"
