"""The exceptions of pipeline parallelism."""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """A pipeline setting that cannot be run (a layer split, a microbatch count, a mesh); raised
    before any rank communicates, with the same message on every rank."""


class PipelineAbortedError(RuntimeError):
    """Another stage of the pipeline raised during a step: this rank stopped instead of waiting for
    data that will never come.  The message names the rank that failed first and its error."""
