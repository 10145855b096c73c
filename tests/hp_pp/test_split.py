"""``split_layers``: the seed's ``pipeline_parallel_layers_per_stage`` rule, and its refusals."""

from __future__ import annotations

import random

import pytest

from hp_pp import PipelineConfigError, split_layers


def test_auto():
    s = split_layers("auto", 8, 2, 2)
    assert s.layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert s.stages_of(0) == (0, 2) and s.stages_of(1) == (1, 3)
    assert [s.rank_of(v) for v in range(4)] == [0, 1, 0, 1]


def test_explicit_seed_example():
    s = split_layers(["0-1, 4-8", "2-3, 9"], 10, 2, 2)
    # segment k of stage i is virtual stage k*pp + i
    assert s.layers == ((0, 1), (2, 3), (4, 5, 6, 7, 8), (9,))
    assert "v3@pp1: layers 9" in s.describe()


def test_generated_splits_round_trip():
    """Random contiguous cuts written as range strings parse back to the same layers."""
    rng = random.Random(0)
    n = 0
    for _ in range(300):
        pp, chunks = rng.randint(1, 4), rng.randint(1, 3)
        nv = pp * chunks
        layers = rng.randint(nv, nv + 12)
        cuts = sorted(rng.sample(range(1, layers), nv - 1))
        bounds = [0, *cuts, layers]
        per_v = [tuple(range(bounds[v], bounds[v + 1])) for v in range(nv)]
        spec = [
            ", ".join(
                f"{per_v[k * pp + i][0]}-{per_v[k * pp + i][-1]}" if len(per_v[k * pp + i]) > 1
                else str(per_v[k * pp + i][0])
                for k in range(chunks)
            )
            for i in range(pp)
        ]
        assert split_layers(spec, layers, pp, chunks).layers == tuple(per_v)
        n += 1
    print(f"[split] {n} generated explicit splits parsed back")


@pytest.mark.parametrize(
    "spec,layers,pp,chunks,match",
    [
        ("auto", 10, 2, 2, r"divisible by pipeline_parallel\*interleave_num .*explicitly.*'0-2, 6-7'"),
        (None, 8, 2, 1, "needs pipeline_parallel_layers_per_stage"),
        (["0-1, 4-8", "2-4, 9"], 10, 2, 2, r"layers \[4\] appear more than once"),
        (["0-1, 5-8", "2-3, 9"], 10, 2, 2, r"layers \[4\] are missing"),
        (["2-3, 4-8", "0-1, 9"], 10, 2, 2, "increasing order of virtual stage"),
        (["0-1, 4-8", "3-2, 9"], 10, 2, 2, "ends before it starts"),
        (["0-1", "2-3, 9"], 10, 2, 2, r"has 1 range\(s\)"),
        (["0-4"], 10, 2, 1, "one entry per stage"),
        (["0-4", "a-9"], 10, 2, 1, "is not a layer 'n' or a closed range"),
        (["0-4", "5-10"], 10, 2, 1, "names layer 10 but the model has 10 layers"),
        (["0-4", 5], 10, 2, 1, "must be a string of ranges"),
        ("even", 8, 2, 1, "must be 'auto' or a list"),
        ("auto", 8, 0, 1, "pipeline_parallel must be a positive int"),
        ("auto", 8, 2, 0, "pipeline_parallel_interleave_num must be a positive int"),
        (["0-4", "5-9", ""], 10, 3, 1, "is not a layer"),
    ],
)
def test_refusals(spec, layers, pp, chunks, match):
    with pytest.raises(PipelineConfigError, match=match):
        split_layers(spec, layers, pp, chunks)
