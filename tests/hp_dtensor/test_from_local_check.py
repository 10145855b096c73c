"""``from_local(run_check=True)``'s record and verdict, one process: records have one width
whatever the arguments (so the exchange cannot mismatch), what ranks must agree on survives the
encoding (dims past the shown ones included), and the verdict is the same for every rank's table.
The exchange itself runs on gloo ranks in ``test_dtensor_errors.py`` and across torch and
MindSpore in ``mindspore/test_ms_torch_run_check_parity.py``."""

from __future__ import annotations

import math
import random
import struct

from hp_dtensor.api.from_local_check import (
    MAX_MESH_NDIM,
    MAX_NDIM,
    RECORD_LEN,
    LocalRecord,
    canonical_dtype,
    data_digest,
    encode,
    verify,
)
from hp_dtensor.layout.mesh_layout import MeshLayout
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard

ONE_D = MeshLayout.contiguous((2,))


def _rec(
    shape: tuple[int, ...] = (2, 3),
    dtype: str = "torch.float32",
    placements: tuple[Placement, ...] = (Shard(0),),
    global_shape: object = None,
    error: Exception | None = None,
    data: bytes = b"x",
    mesh_ndim: int = 1,
) -> list[int]:
    return encode(error, shape, dtype, placements, mesh_ndim, global_shape, data_digest(data))


def _verdict(rows: list[list[int]], layout: MeshLayout = ONE_D) -> str:
    try:
        verify(rows, layout)
    except ValueError as e:
        return str(e)
    return "ok"


def test_records_have_one_width_and_round_trip() -> None:
    rng = random.Random(7)
    n = 0
    for _ in range(300):
        ndim = rng.randrange(0, 24)
        shape = tuple(rng.randrange(0, 9) for _ in range(ndim))
        mesh_ndim = rng.randrange(1, 11)
        pl = tuple(rng.choice([Replicate(), Partial("max"), Shard(rng.randrange(-3, 3))]) for _ in range(mesh_ndim))
        gs = rng.choice([None, shape, "not a shape", (10**30,) * ndim, [object()]])
        row = encode(rng.choice([None, ValueError("bad")]), shape, rng.choice(["torch.bfloat16", "Float32"]), pl,
                     mesh_ndim, gs, data_digest(bytes(rng.randrange(256) for _ in range(8))))
        assert len(row) == RECORD_LEN and all(-(2**63) <= x < 2**63 for x in row)
        rec = LocalRecord.decode(row)
        assert rec.ndim == ndim and rec.shape == shape[:MAX_NDIM]
        assert rec.shown_shape().endswith(", ...)") == (ndim > MAX_NDIM)
        assert rec.dtype in ("bfloat16", "float32")
        n += 1
    print(f"records encoded and decoded: {n}, width {RECORD_LEN}")


def test_canonical_dtype_names_agree_across_frameworks() -> None:
    pairs = [("torch.float32", "Float32"), ("torch.bfloat16", "BFloat16"), ("torch.bool", "Bool"),
             ("torch.uint8", "UInt8"), ("torch.complex64", "Complex64"), ("torch.int64", "Int64")]
    for t, m in pairs:
        assert canonical_dtype(t) == canonical_dtype(m)


def test_digest_is_of_the_exact_bytes() -> None:
    f = lambda *xs: struct.pack(f"<{len(xs)}f", *xs)  # noqa: E731
    nan = math.nan
    assert data_digest(f(nan, 1.0)) == data_digest(f(nan, 1.0))  # the same NaN: the same data
    assert data_digest(f(nan, 1.0)) != data_digest(f(nan, 2.0))  # a NaN hides nothing else
    assert data_digest(f(0.0)) != data_digest(f(-0.0))
    big = lambda x: struct.pack("<2d", 1e20, x)  # noqa: E731
    assert 1e20 + 1.0 == 1e20 + 2.0 and data_digest(big(1.0)) != data_digest(big(2.0))


def test_dims_past_the_shown_ones_are_compared() -> None:
    a, b = (1,) * 17 + (2,), (1,) * 17 + (3,)
    msg = _verdict([_rec(shape=a, placements=(Replicate(),)), _rec(shape=b, placements=(Replicate(),))])
    assert "the local shape differs" in msg and "rank 0: (1, 1, 1" in msg and ", ...)" in msg, msg
    pl_a, pl_b = (Replicate(),) * 9 + (Shard(0),), (Replicate(),) * 9 + (Shard(1),)
    msg = _verdict([_rec(placements=pl_a, mesh_ndim=10), _rec(placements=pl_b, mesh_ndim=10)])
    assert "the placements differs" in msg and ", ...]" in msg and len(pl_a) > MAX_MESH_NDIM, msg


def test_verdicts() -> None:
    cases = {
        # equal records: accepted
        "same": ([_rec(), _rec()], "ok"),
        "dtype": ([_rec(), _rec(dtype="Int32")], "the dtype differs across the mesh (rank 0: float32, rank 1: int32)"),
        "negative shard dim is the same placement": ([_rec(), _rec(placements=(Shard(-2),))], "ok"),
        "shape= unreadable on one rank": ([_rec(global_shape=(4, 3)), _rec(global_shape="x")],
                                          "the shape= argument differs across the mesh (rank 0: (4, 3), rank 1: ?)"),
        # every rank's own check failed with the same error: each raises that error
        "all fail alike": ([_rec(error=ValueError("e")), _rec(error=ValueError("e"))], "ok"),
        # ... with different errors: one verdict instead
        "all fail differently": ([_rec(error=ValueError("e0")), _rec(error=ValueError("e1"))],
                                 "the arguments failed their checks on ranks [0, 1]"),
        "one fails": ([_rec(), _rec(error=TypeError("t"))], "the arguments failed their checks on ranks [1]"),
        # the tiling verdict comes first: it names every rank's shard, where each rank's error names its own
        "does not tile": ([_rec(shape=(2, 3), global_shape=(5, 3), error=ValueError("r0")),
                           _rec(shape=(2, 3), global_shape=(5, 3))],
                          "local shards do not tile shape=(5, 3) with placements (Shard(dim=0),) "
                          "(rank 0: (2, 3) (want (3, 3)), rank 1: (2, 3) (want (2, 3)))"),
        "replicate data": ([_rec(placements=(Replicate(),), data=b"a"), _rec(placements=(Replicate(),), data=b"b")],
                           "placement Replicate() on mesh dim 0 but ranks [0, 1] hold different data"),
        "sharded data may differ": ([_rec(data=b"a"), _rec(data=b"b")], "ok"),
    }
    for name, (rows, want) in cases.items():
        got = _verdict(rows)
        assert (got == "ok") if want == "ok" else (want in got), (name, got)


def test_replicate_is_checked_per_group_on_a_2d_mesh() -> None:
    layout = MeshLayout.contiguous((2, 2))
    pl = (Shard(0), Replicate())
    rows = [_rec(placements=pl, mesh_ndim=2, data=d) for d in (b"a", b"a", b"b", b"c")]
    assert "Replicate() on mesh dim 1 but ranks [2, 3] hold different data" in _verdict(rows, layout)
    rows = [_rec(placements=pl, mesh_ndim=2, data=d) for d in (b"a", b"a", b"b", b"b")]
    assert _verdict(rows, layout) == "ok"

