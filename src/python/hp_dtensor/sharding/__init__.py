"""Sharding-propagation rules, written once on shapes and placements (no framework import).

A rule receives an ``OpCall`` (global shapes and placements of the DTensor arguments, the other
arguments as given) and returns a ``Decision``: the placements each DTensor input must be
redistributed to, the placements of each output, and optionally rewritten non-tensor arguments
for the local call (a ``view`` of a sharded tensor needs local sizes).  The platform maps its ops
to these rules and caches decisions per (op, input specs, arguments).
"""

from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo

__all__ = ["Decision", "OpCall", "TensorInfo"]
