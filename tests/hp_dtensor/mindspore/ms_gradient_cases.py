# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,var-annotated,assignment"
"""What the MindSpore gradient tests share: a rank's shard of a global array, random layouts, and
the comparison of an op's value and input gradient on a DTensor against one-process MindSpore.

The reference is the same op on the whole array in one process, through ``ms.vjp`` (one forward
for the value and the cotangent's shape, then its backward), and the DTensor side takes value and
gradient from one ``ms.value_and_grad``: each case runs the op once per side.
"""

from __future__ import annotations

import numpy as np

MESHES = [(4,), (2, 2)]  # a 1-D and a 2x2 mesh of the 4 ranks
RTOL, ATOL = 1.5e-4, 1e-5


def slice_of(a, placements, mesh_shape, coord):
    """This rank's shard of ``a`` (nested shards split the previous mesh dim's chunk, as torch)."""
    for k, p in enumerate(placements):
        if p.is_shard():
            a = np.split(a, mesh_shape[k], axis=p.dim)[coord[k]]
    return a


def random_placements(rs, ndim, mesh_shape):
    from hp_dtensor import Replicate, Shard

    return [Shard(int(rs.randint(ndim))) if rs.rand() < 0.75 else Replicate() for _ in mesh_shape]


def compare(mesh, placements, A, f, cotangent, comm_counts=None):
    """(value error, gradient error) of ``f`` on the DTensor laid out from ``A`` against ``f`` on
    ``A`` in one process.  ``cotangent(shape)`` draws the output's cotangent ``G`` once the
    reference has given the output's shape (every rank draws the same one); the gradients are
    ``G``'s pullbacks, compared shard by shard.  The value compared is the one the gradient's
    forward computed.  ``comm_counts``, when given, receives the collectives ``f`` alone issues in
    that forward (not the gather of its output for the comparison, nor the backward's)."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import CommDebugMode, DTensor

    coord = mesh.get_coordinate()
    local = Tensor(slice_of(A, placements, mesh.shape, coord))
    want, pull_back = ms.vjp(f, Tensor(A))
    G = Tensor(np.asarray(cotangent(tuple(want.shape)), np.float32))
    (want_grad,) = pull_back(G)

    def dtensor_f(xl):
        if comm_counts is None:
            return f(DTensor.from_local(xl, mesh, placements)).full_tensor()
        with CommDebugMode() as comm:
            out = f(DTensor.from_local(xl, mesh, placements))
        comm_counts.add(tuple(sorted(comm.get_comm_counts().items())))
        return out.full_tensor()

    got, dt_pull_back = ms.vjp(dtensor_f, local)
    (grad,) = dt_pull_back(G)
    got, want, grad = got.asnumpy(), want.asnumpy(), grad.asnumpy()
    want_grad = slice_of(want_grad.asnumpy(), placements, mesh.shape, coord)
    if got.shape != want.shape or grad.shape != want_grad.shape:
        return float("inf"), float("inf")
    return rel_err(got, want), rel_err(grad, want_grad)


def rel_err(got, want):
    """max |got - want| in units of the fp32 tolerance (<= 1 passes)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want) / (ATOL + RTOL * np.abs(want))))


def abs_err(mesh, placements, A, G, f):
    """The plain max absolute errors (value, gradient), for the figures printed."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor

    coord = mesh.get_coordinate()
    local = Tensor(slice_of(A, placements, mesh.shape, coord))
    got = f(DTensor.from_local(local, mesh, placements)).full_tensor().asnumpy()
    want = f(Tensor(A)).asnumpy()
    grad = ms.grad(lambda xl: (f(DTensor.from_local(xl, mesh, placements)).full_tensor() * Tensor(G)).sum())(local)
    want_grad = slice_of(ms.grad(lambda x: (f(x) * Tensor(G)).sum())(Tensor(A)).asnumpy(), placements, mesh.shape, coord)
    return float(np.abs(got - want).max()), float(np.abs(grad.asnumpy() - want_grad).max())
