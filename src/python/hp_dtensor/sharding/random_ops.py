"""Which ops draw random numbers, by the name each framework's dispatch reports.

A random op cannot run on each rank's shard as other ops do: drawn per rank, a replicated result
would differ across ranks.  A DTensor runs such an op whole instead (every rank draws the global
tensor and keeps its slice: ``hp_dtensor.api.rng_tracker`` on torch's generator,
``hp_dtensor.api.random_stream`` on MindSpore), or refuses it; how each kind is drawn is the
platform's.  The tables are plain data, beside the rule tables.
"""

from __future__ import annotations

import enum


class RandomKind(enum.Enum):
    """How a random op uses its first argument, which decides how its global draw is made."""

    FILL = "fill"  # overwrites it with fresh draws (its values are not read)
    LIKE = "like"  # returns fresh draws shaped like it (its values are not read)
    BY_VALUE = "by value"  # draws from its values (probabilities)
    DROPOUT = "dropout"  # a mask drawn like it, applied to its values


def _by_name(*kinds: tuple[RandomKind, str]) -> dict[str, RandomKind]:
    """``{"aten.<name>": kind}`` for each kind's whitespace-separated names; a name given two
    kinds is an error at import."""
    table: dict[str, RandomKind] = {}
    for kind, names in kinds:
        for name in (f"aten.{n}" for n in names.split()):
            if name in table:
                raise ValueError(f"random op {name} is listed as {table[name]} and {kind}")
            table[name] = kind
    return table


# torch's random aten ops (``str(op)``) and how each draws.
ATEN_RANDOM_OPS = _by_name(
    (RandomKind.FILL, "normal_.default uniform_.default bernoulli_.float exponential_.default geometric_.default "
                      "cauchy_.default log_normal_.default random_.default random_.from random_.to"),
    (RandomKind.LIKE, "rand_like.default randn_like.default randint_like.default randint_like.low_dtype bernoulli.p"),
    (RandomKind.BY_VALUE, "bernoulli.default bernoulli_.Tensor"),
    (RandomKind.DROPOUT, "native_dropout.default"),
)

# MindSpore's random primitives that a DTensor refuses: no DTensor semantics here (and, for most,
# no CPU kernel in MindSpore 2.10).  The ones it draws from its job-wide stream are the platform's.
MINDSPORE_REFUSED_RANDOM_OPS = frozenset((
    "Bernoulli", "BernoulliExt", "InplaceBernoulliScalar", "InplaceBernoulliTensor", "Multinomial",
    "MultinomialExt", "RandomShuffle", "RandomCategorical", "InplaceExponential", "InplaceRandom",
    "RandIntLike", "LogNormalReverse", "UniformExt", "NormalTensorTensor", "NormalTensorFloat",
    "NormalFloatTensor", "NormalFloatFloat", "DropoutExt", "DropoutGenMaskExt", "RandpermExt",
    "StandardNormal", "UniformReal", "UniformInt", "Gamma", "RandomGamma", "Poisson", "RandomPoisson",
))
