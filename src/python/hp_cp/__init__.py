"""hp_cp: context parallelism -- the sequence split over ranks with load-balanced causal chunks,
ring (colossal), Ulysses and hybrid attention, compressed causal and EOD masks."""

from hp_cp.api import ContextParallel
from hp_cp.config import COMPRESSION_REQUIRED, ContextParallelConfig, CPMaskType, CPMethod, MaskCompression
from hp_cp.layout import (
    BlockKind,
    RingPlan,
    Segment,
    actual_seq_len_from_eod,
    check_seq_len,
    chunk_ids,
    document_ids,
    document_position_ids,
    rank_segments,
)

__version__ = "0.1.0"

__all__ = [
    "COMPRESSION_REQUIRED", "BlockKind", "CPMaskType", "CPMethod", "ContextParallel", "ContextParallelConfig",
    "MaskCompression", "RingPlan", "Segment", "actual_seq_len_from_eod", "check_seq_len", "chunk_ids",
    "document_ids", "document_position_ids", "rank_segments",
]
