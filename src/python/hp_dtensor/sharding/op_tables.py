"""Every op each framework's dispatch has a sharding rule for, gathered from the rule modules.

Each module of this package lists the ops its rules cover, by the names the framework's dispatch
reports (``ATEN_OPS`` for torch's aten ops, ``MINDSPORE_OPS`` for MindSpore's primitives); the
tables are plain data, so they live with the rules and import no framework.  A backend looks an
op up here by name and keeps only the local kernels some rules need.
"""

from __future__ import annotations

from hp_dtensor.sharding import (
    attention,
    casts,
    embedding,
    factories,
    indexing,
    local_updates,
    loss,
    matrix,
    norms,
    pointwise,
    python_values,
    reductions,
    triangular,
    views,
)
from hp_dtensor.sharding.foreach import FOREACH_RULES
from hp_dtensor.sharding.op_call import OpRules

ATEN_RULES = OpRules().merge(
    pointwise.ATEN_OPS, casts.ATEN_OPS, factories.ATEN_OPS, matrix.ATEN_OPS, views.ATEN_OPS, reductions.ATEN_OPS,
    norms.ATEN_OPS, attention.ATEN_OPS, embedding.ATEN_OPS, loss.ATEN_OPS, indexing.ATEN_OPS,
    triangular.ATEN_OPS, python_values.ATEN_OPS,
)
MINDSPORE_RULES = OpRules().merge(
    pointwise.MINDSPORE_OPS, casts.MINDSPORE_OPS, matrix.MINDSPORE_OPS, views.MINDSPORE_OPS,
    reductions.MINDSPORE_OPS, norms.MINDSPORE_OPS, embedding.MINDSPORE_OPS, python_values.MINDSPORE_OPS,
    local_updates.MINDSPORE_OPS,
)

__all__ = ["ATEN_RULES", "FOREACH_RULES", "MINDSPORE_RULES"]
