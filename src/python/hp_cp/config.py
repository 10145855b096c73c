"""Context-parallel configuration and its fail-closed checks (framework-neutral).

The names follow the parallelism config users write: ``context_parallel`` (the degree),
``context_parallel_method`` (colossal = ring, ulysses = all-to-all onto heads, hybrid = ulysses
inside groups and ring across them), ``context_parallel_async``, ``ulysses_degree_in_cp``,
``context_parallel_mask_type`` and the mask compression the data or the model turns on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# The exact words users of the parallelism config know from its documentation.
COMPRESSION_REQUIRED = (
    "Context parallel (context_parallel > 1) requires a compressed attention mask. Please enable "
    "use_attn_mask_compression for non-eod data, or create_compressed_eod_mask for eod data."
)


class CPMethod(Enum):
    COLOSSAL = "colossal"
    ULYSSES = "ulysses"
    HYBRID = "hybrid"

    @classmethod
    def parse(cls, value: CPMethod | str) -> CPMethod:
        if isinstance(value, CPMethod):
            return value
        for m in cls:
            if m.value == value:
                return m
        raise ValueError(
            f"context_parallel_method must be one of {[m.value for m in cls]}, got {value!r}"
        )


class CPMaskType(Enum):
    """The mask the CP input preparation splits for; only ``causal`` is implemented."""

    CAUSAL = "causal"
    FULL = "full"


class MaskCompression(Enum):
    """How the attention mask reaches the attention kernel: never as a dense seq x seq matrix
    under CP.  ``CAUSAL``: the model's ``use_attn_mask_compression`` (the mask is implied by
    positions); ``EOD``: the data's ``create_compressed_eod_mask`` (the mask is implied by the
    documents' cumulative lengths, ``actual_seq_len``)."""

    NONE = "none"
    CAUSAL = "causal"
    EOD = "eod"


@dataclass(frozen=True)
class ContextParallelConfig:
    degree: int = 1
    method: CPMethod = CPMethod.COLOSSAL
    async_comm: bool = False
    ulysses_degree: int | None = None
    mask_type: CPMaskType | str = CPMaskType.CAUSAL
    compression: MaskCompression = MaskCompression.CAUSAL

    def ulysses(self) -> int:
        """The ulysses degree the method runs with (1 for colossal), after ``validate``."""
        if self.method is CPMethod.COLOSSAL:
            return 1
        if self.method is CPMethod.ULYSSES:
            return self.degree if self.ulysses_degree is None else self.ulysses_degree
        assert self.ulysses_degree is not None
        return self.ulysses_degree

    def validate(self) -> None:
        """Raise the documented error for a configuration CP cannot run: ``ValueError`` for
        degrees, ``NotImplementedError`` for a mask type other than causal."""
        if not isinstance(self.degree, int) or isinstance(self.degree, bool) or self.degree < 1:
            raise ValueError(f"context_parallel must be a positive int, got {self.degree!r}")
        if not isinstance(self.method, CPMethod):
            raise TypeError(f"method must be a CPMethod (use CPMethod.parse), got {self.method!r}")
        mask = self.mask_type.value if isinstance(self.mask_type, CPMaskType) else self.mask_type
        if self.degree > 1 and mask != CPMaskType.CAUSAL.value:
            raise NotImplementedError(
                f"context_parallel_mask_type {mask!r} is not supported: CP input preparation supports only "
                f"'causal' (set context_parallel_mask_type: causal)"
            )
        if self.degree > 1 and self.compression is MaskCompression.NONE:
            raise ValueError(COMPRESSION_REQUIRED)
        u = self.ulysses_degree
        if self.method is CPMethod.ULYSSES and u is not None and u != self.degree:
            raise ValueError(
                f"context_parallel_method ulysses needs ulysses_degree_in_cp == context_parallel, got "
                f"ulysses_degree_in_cp {u} and context_parallel {self.degree} (leave it unset or set it to "
                f"{self.degree})"
            )
        if self.method is CPMethod.HYBRID:
            if u is None or not (1 < u < self.degree) or self.degree % u != 0:
                raise ValueError(
                    f"context_parallel_method hybrid needs 1 < ulysses_degree_in_cp < context_parallel and "
                    f"context_parallel % ulysses_degree_in_cp == 0, got ulysses_degree_in_cp {u} and "
                    f"context_parallel {self.degree}"
                )

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Ulysses moves whole heads between ranks: the query heads must divide by its degree
        (key/value heads that do not are replicated up to the query heads)."""
        u = self.ulysses()
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads {num_heads} must be a multiple of num_key_value_heads {num_kv_heads}"
            )
        if u > 1 and num_heads % u != 0:
            raise ValueError(
                f"context_parallel_method {self.method.value} splits heads over ulysses degree {u}, but "
                f"num_attention_heads {num_heads} is not divisible by {u}; use colossal, or a ulysses degree "
                f"that divides the head count"
            )
