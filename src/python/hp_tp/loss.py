"""``loss_parallel``: cross entropy on vocab-sharded logits without gathering the vocab dim."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hp_tp.platform import current as _platform


@contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside this context, ``cross_entropy`` (log_softmax + nll_loss) on logits placed
    ``Shard(-1)`` over a 1-D mesh -- the output of ``ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False)`` -- reduces max and sum-exp across ranks and picks each target from
    the rank owning its vocab slice.  Loss and gradients equal the single-device ones; the
    logits are never gathered.  Run ``loss.backward()`` inside the context too."""
    with _platform().loss_parallel():
        yield
