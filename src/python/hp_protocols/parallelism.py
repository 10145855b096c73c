"""The parallelism configuration users write in a job file, its derived sizes and its rules.

A job file has a ``parallelism:`` section (``ParallelismConfig``), a ``training:`` section (batch
sizes, learning-rate schedule, gradient clipping, mixed precision) and optionally the ``model:``
facts and ``train_dataset.dataloader.config`` flags the rules need (head and layer counts,
attention-mask compression); a whole MindFormers file is accepted, its other sections named as
ignored (``hp_protocols.job_file``).  ``ParallelismConfig.resolve(world_size,
...)`` checks every rule and returns the derived sizes (``ParallelDims``).  Pure: no framework.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hp_protocols.job_file import JobFileParts, split_job_file
from hp_protocols.train_features import ActivationCheckpointConfig, FloatDType

_RESHARD = ("always", "never", "default")
_CP_METHODS = ("colossal", "ulysses", "hybrid")
_DISPATCHERS = ("alltoall", "alltoall_deredundancy")


@dataclass(kw_only=True)
class ParallelismConfig:
    """Every field of a job file's ``parallelism:`` section, with its default."""

    data_parallel_shard: int = -1
    reshard_after_forward_policy: str = "default"
    cpu_offload: bool = False
    disable_gradient_division: bool = True
    tensor_parallel: int = 1
    context_parallel: int = 1
    context_parallel_method: str = "colossal"
    context_parallel_async: bool = False
    ulysses_degree_in_cp: int | None = None
    context_parallel_mask_type: str = "causal"
    pipeline_parallel: int = 1
    pipeline_parallel_interleave_num: int = 1
    pipeline_parallel_layers_per_stage: str | list[str] | None = None
    pipeline_parallel_overlap_p2p: bool = False
    pipeline_parallel_overlap_b_f: bool = False
    pipeline_parallel_microbatch_size: int = 1  # derived at resolve time (= accumulation steps)
    pipeline_parallel_schedule: str = "1f1b"  # reserved: interleaved 1F1B is always used
    pipeline_parallel_enable_dxdw_split: bool = False  # reserved
    expert_parallel: int = 1
    moe_token_dispatcher_type: str = "alltoall"
    npu_nums_per_device: int = 8


class LRDecay(Enum):
    """How the learning rate falls after the warmup: not at all, along a half cosine, or linearly
    (to ``lr_min`` at the end of the decay steps)."""

    NONE = "none"
    COSINE = "cosine"
    LINEAR = "linear"

    @classmethod
    def parse(cls, value: LRDecay | str) -> LRDecay:
        if isinstance(value, LRDecay):
            return value
        for kind in cls:
            if kind.value == value:
                return kind
        raise ValueError(f"lr_decay must be one of {[k.value for k in cls]}, got {value!r}")


@dataclass(kw_only=True)
class TrainingConfig:
    """A job file's ``training:`` section: batch sizes, the learning-rate schedule (linear warmup
    over ``lr_warmup_steps``, then ``lr_decay`` to ``lr_min`` over ``lr_decay_steps``; the default
    keeps the learning rate constant), gradient clipping (``max_grad_norm``: the global norm
    over every parameter; None: no clipping) and mixed precision (``param_dtype``,
    ``reduce_dtype``)."""

    global_batch_size: int | None = None
    local_batch_size: int = 1
    learning_rate: float | None = None  # the peak rate; None: the trainer's default (its --lr)
    lr_warmup_steps: int = 0
    lr_warmup_ratio: float | None = None  # the warmup as a share of the run's steps (instead of lr_warmup_steps)
    lr_decay: str = "none"
    lr_decay_steps: int | None = None  # None: the steps after the warmup, to the end of the run
    lr_min: float = 0.0
    max_grad_norm: float | None = None
    # AdamW's settings (a MindFormers file's optimizer: section maps onto them)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    # mixed precision (FSDP2's MixedPrecisionPolicy): compute dtype of the gathered parameters,
    # and dtype of the gradient reduction; the optimizer's master parameters stay float32
    param_dtype: FloatDType = FloatDType.FLOAT32
    reduce_dtype: FloatDType = FloatDType.FLOAT32

    def __post_init__(self) -> None:
        self.param_dtype = FloatDType.parse(self.param_dtype, "param_dtype")
        self.reduce_dtype = FloatDType.parse(self.reduce_dtype, "reduce_dtype")
        if isinstance(self.adam_betas, list):  # (as YAML gives it)
            self.adam_betas = tuple(self.adam_betas)  # type: ignore[assignment]


@dataclass(kw_only=True)
class ModelFacts:
    """What the rules need to know about the model."""

    num_attention_heads: int | None = None
    num_hidden_layers: int | None = None
    use_attn_mask_compression: bool = False


@dataclass(kw_only=True)
class DataFacts:
    """``train_dataset.dataloader.config`` flags the CP mask rule reads."""

    create_compressed_eod_mask: bool = False
    create_attention_mask: bool = True


@dataclass(kw_only=True)
class JobConfig:
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    model: ModelFacts = field(default_factory=ModelFacts)
    data: DataFacts = field(default_factory=DataFacts)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)

    # dotted names of the job file's sections and keys this config does not read (printed once by
    # the caller; see ``hp_protocols.job_file`` for which are read and which raise)
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> JobConfig:
        """A whole MindFormers job file's mapping: ``parallelism``, ``training`` and
        ``activation_checkpoint`` read whole,
        the model and data-set facts the rules need, every other section and key named in
        ``ignored``; a misspelt key raises ``ValueError`` naming it (``hp_protocols.job_file``)."""
        parts = job_file_parts(raw)
        return cls(
            parallelism=_build(ParallelismConfig, parts.parallelism, "parallelism"),
            training=_build(TrainingConfig, parts.training, "training"),
            model=_build(ModelFacts, parts.model, "model"),
            data=_build(DataFacts, parts.data, "train_dataset.dataloader.config"),
            activation_checkpoint=_build(ActivationCheckpointConfig, parts.activation_checkpoint,
                                         "activation_checkpoint"),
            ignored=parts.ignored,
        )

    @classmethod
    def from_yaml(cls, path_or_text: str) -> JobConfig:
        import yaml

        text = path_or_text
        if os.path.exists(path_or_text):
            with open(path_or_text) as f:
                text = f.read()
        return cls.from_dict(yaml.safe_load(text) or {})

    def resolve(self, world_size: int) -> ParallelDims:
        return resolve(self, world_size)


def job_file_parts(raw: Mapping[str, Any]) -> JobFileParts:
    """What this config reads of a whole job file's mapping, canonical, and what it ignores."""
    return split_job_file(raw, _field_names(ParallelismConfig), _field_names(TrainingConfig),
                          _field_names(ActivationCheckpointConfig))


def _field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls: Any, raw: dict[str, Any], section: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"section {section!r} must be a mapping, got {type(raw).__name__}")
    names = set(_field_names(cls))
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {section}; known keys are {sorted(names)}")
    return cls(**raw)


@dataclass(frozen=True)
class ParallelDims:
    """Derived sizes of a validated configuration."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    data_parallel: int
    ulysses_degree: int
    num_accumulation_steps: int | None
    reshard_after_forward: bool
    virtual_stages: int
    stage_layers: tuple[tuple[int, ...], ...] | None  # layers of each virtual stage, in order

    def __post_init__(self) -> None:
        # EP reuses the dp_shard*cp*tp ranks: the sparse mesh needs a whole number of ep groups there.
        shard = self.dp_shard * self.cp * self.tp
        if self.ep < 1 or shard % self.ep:
            raise ValueError(
                f"expert_parallel {self.ep} must divide dp_shard*cp*tp = {self.dp_shard}*{self.cp}*{self.tp} = "
                f"{shard} (efsdp = dp_shard*cp*tp // ep must be a positive integer)"
            )

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def etp(self) -> int:
        """Ranks that split each expert like a TP MLP: with ``ep`` dividing ``tp`` (``ep <= tp``)
        the ``tp // ep`` TP ranks sharing an ep coordinate, so the experts keep that part of their
        TP split; 1 when ``ep > tp`` (EP then spans TP ranks) or ``ep`` does not divide ``tp``."""
        return self.tp // self.ep if self.tp % self.ep == 0 else 1

    @property
    def edp(self) -> int:
        """The data-parallel ranks over which experts split by ``etp`` are fully sharded:
        ``efsdp // etp`` (``efsdp`` itself when ``etp`` is 1)."""
        return self.efsdp // self.etp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1  # SP always follows TP

    @property
    def pipeline_microbatches(self) -> int | None:
        return self.num_accumulation_steps

    def dense_mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.fsdp, self.tp)

    def sparse_mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.efsdp, self.ep)

    def expert_mesh_shape(self) -> tuple[int, int, int, int, int]:
        """The sparse mesh with ``efsdp`` split as ``(edp, etp)``, ep innermost: the same ranks in
        the same order as ``sparse_mesh_shape`` (an ``efsdp`` index is ``edp_index * etp +
        etp_index``), so an ``etp`` group is the TP ranks of one TP group sharing an ep coordinate."""
        return (self.pp, self.dp_replicate, self.edp, self.etp, self.ep)

    def build_mesh(self, device_type: str = "cpu") -> tuple[Any, Any | None]:
        """(dense mesh ``[pp, dp_replicate, fsdp, tp]``, sparse mesh ``[pp, dp_replicate, efsdp, ep]``
        or None when ep == 1) as hp_dtensor DeviceMeshes."""
        from hp_dtensor import init_device_mesh

        dense = init_device_mesh(device_type, self.dense_mesh_shape(), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        sparse = None
        if self.ep > 1:
            sparse = init_device_mesh(
                device_type, self.sparse_mesh_shape(), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep")
            )
        return dense, sparse


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def resolve(job: JobConfig, world_size: int) -> ParallelDims:
    """Validate ``job`` for ``world_size`` ranks and derive every size (one check below per rule)."""
    p, t, m, d = job.parallelism, job.training, job.model, job.data
    _positive("world_size", world_size)
    for name in ("tensor_parallel", "context_parallel", "pipeline_parallel", "expert_parallel",
                 "pipeline_parallel_interleave_num", "npu_nums_per_device"):
        _positive(name, getattr(p, name))
    tp, cp, pp, ep = p.tensor_parallel, p.context_parallel, p.pipeline_parallel, p.expert_parallel
    model_ranks = tp * pp * cp
    if world_size < model_ranks:
        raise ValueError(
            f"data_parallel = world_size // (tensor_parallel*pipeline_parallel*context_parallel) = {world_size} // "
            f"({tp}*{pp}*{cp}) = {world_size // model_ranks} must be >= 1: the job needs at least {model_ranks} ranks"
        )
    if world_size % model_ranks != 0:
        raise ValueError(
            f"world_size {world_size} is not divisible by tensor_parallel*pipeline_parallel*context_parallel "
            f"= {tp}*{pp}*{cp} = {model_ranks}"
        )
    data_parallel = world_size // model_ranks
    shard = p.data_parallel_shard
    if shard == -1:
        dp_shard = data_parallel
    elif isinstance(shard, int) and not isinstance(shard, bool) and shard >= 1:
        dp_shard = shard
    else:
        raise ValueError(f"data_parallel_shard must be -1 or a positive int, got {shard!r}")
    if data_parallel % dp_shard != 0:
        raise ValueError(
            f"data_parallel ({data_parallel} = world_size {world_size} // (tp*pp*cp)) is not divisible by "
            f"data_parallel_shard {dp_shard}"
        )
    dp_replicate = data_parallel // dp_shard
    assert dp_replicate * dp_shard * cp * tp * pp == world_size

    # batch sizes
    _positive("local_batch_size", t.local_batch_size)
    accumulation = None
    if t.global_batch_size is not None:
        _positive("global_batch_size", t.global_batch_size)
        if data_parallel * t.local_batch_size > t.global_batch_size:
            raise ValueError(
                f"data_parallel * local_batch_size = {data_parallel} * {t.local_batch_size} = "
                f"{data_parallel * t.local_batch_size} exceeds global_batch_size {t.global_batch_size}"
            )
        accumulation = t.global_batch_size // (data_parallel * t.local_batch_size)
    check_training(t)

    # FSDP
    if p.reshard_after_forward_policy not in _RESHARD:
        raise ValueError(f"reshard_after_forward_policy must be one of {_RESHARD}, got {p.reshard_after_forward_policy!r}")
    policy = p.reshard_after_forward_policy
    reshard = policy == "always" or (policy == "default" and pp == 1)

    # CP
    ulysses = _check_cp(p, m, d, cp)

    # PP
    virtual = pp * p.pipeline_parallel_interleave_num
    stage_layers = _stage_layers(p, m, pp, virtual) if pp > 1 else None

    # EP
    if p.moe_token_dispatcher_type not in _DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type must be one of {_DISPATCHERS}, got {p.moe_token_dispatcher_type!r}")
    # (ep dividing dp_shard*cp*tp is ParallelDims' own rule, checked when it is built below)
    if p.moe_token_dispatcher_type == "alltoall_deredundancy" and ep < p.npu_nums_per_device:
        raise ValueError(
            f"moe_token_dispatcher_type alltoall_deredundancy needs expert_parallel ({ep}) >= "
            f"npu_nums_per_device ({p.npu_nums_per_device})"
        )
    if p.moe_token_dispatcher_type == "alltoall_deredundancy" and ep % p.npu_nums_per_device:
        # the dispatcher groups the ep ranks into nodes of npu_nums_per_device ranks
        raise ValueError(
            f"moe_token_dispatcher_type alltoall_deredundancy needs expert_parallel ({ep}) to be a multiple of "
            f"npu_nums_per_device ({p.npu_nums_per_device}), so the ep group spans whole nodes"
        )
    return ParallelDims(
        world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep,
        data_parallel=data_parallel, ulysses_degree=ulysses, num_accumulation_steps=accumulation,
        reshard_after_forward=reshard, virtual_stages=virtual, stage_layers=stage_layers,
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_training(t: TrainingConfig) -> None:
    """The learning-rate schedule and clipping fields of ``training:``: ``ValueError`` naming the
    field and its value."""
    w = t.lr_warmup_steps
    if not isinstance(w, int) or isinstance(w, bool) or w < 0:
        raise ValueError(f"lr_warmup_steps must be an int >= 0 (0: no warmup), got {w!r}")
    LRDecay.parse(t.lr_decay)
    if t.lr_decay_steps is not None:
        _positive("lr_decay_steps", t.lr_decay_steps)
    if not _number(t.lr_min) or t.lr_min < 0:
        raise ValueError(f"lr_min must be a number >= 0, got {t.lr_min!r}")
    g = t.max_grad_norm
    if g is not None and (not _number(g) or g <= 0):
        raise ValueError(f"max_grad_norm must be a number > 0 (or absent: no clipping), got {g!r}")
    if t.learning_rate is not None and (not _number(t.learning_rate) or t.learning_rate <= 0):
        raise ValueError(f"learning_rate must be a number > 0, got {t.learning_rate!r}")
    r = t.lr_warmup_ratio
    if r is not None and (not _number(r) or not 0 <= r <= 1):
        raise ValueError(f"lr_warmup_ratio must be a number in [0, 1], got {r!r}")
    if r is not None and w:
        raise ValueError(f"lr_warmup_steps {w} and lr_warmup_ratio {r} both set the warmup; keep one")
    b = t.adam_betas
    if not isinstance(b, tuple) or len(b) != 2 or not all(_number(x) and 0 <= x < 1 for x in b):
        raise ValueError(f"adam_betas must be two numbers in [0, 1), got {b!r}")
    if not _number(t.adam_eps) or t.adam_eps <= 0:
        raise ValueError(f"adam_eps must be a number > 0, got {t.adam_eps!r}")
    if not _number(t.weight_decay) or t.weight_decay < 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {t.weight_decay!r}")


def _check_cp(p: ParallelismConfig, m: ModelFacts, d: DataFacts, cp: int) -> int:
    method = p.context_parallel_method
    if method not in _CP_METHODS:
        raise ValueError(f"context_parallel_method must be one of {_CP_METHODS}, got {method!r}")
    u = p.ulysses_degree_in_cp
    if method == "colossal":
        ulysses = 1
    elif method == "ulysses":
        ulysses = cp if u is None else u
        if ulysses != cp:
            raise ValueError(
                f"context_parallel_method ulysses needs ulysses_degree_in_cp == context_parallel, got "
                f"ulysses_degree_in_cp {ulysses} and context_parallel {cp}"
            )
    else:
        if u is None:
            raise ValueError("context_parallel_method hybrid needs ulysses_degree_in_cp to be set")
        if not (1 < u < cp) or cp % u != 0:
            raise ValueError(
                f"context_parallel_method hybrid needs 1 < ulysses_degree_in_cp < context_parallel and "
                f"context_parallel % ulysses_degree_in_cp == 0, got ulysses_degree_in_cp {u} and context_parallel {cp}"
            )
        ulysses = u
    if p.context_parallel_async and method in ("ulysses", "hybrid"):
        if m.num_attention_heads is None:
            raise ValueError("context_parallel_async with ulysses needs model.num_attention_heads to check divisibility")
        if m.num_attention_heads % ulysses != 0:
            raise ValueError(
                f"context_parallel_async with ulysses needs num_attention_heads % ulysses_degree == 0, got "
                f"num_attention_heads {m.num_attention_heads} and ulysses degree {ulysses}"
            )
    if cp > 1:
        if p.context_parallel_mask_type != "causal":
            raise NotImplementedError(
                f"context_parallel_mask_type {p.context_parallel_mask_type!r} is not supported: CP input "
                f"preparation supports only 'causal'"
            )
        eod_ok = d.create_compressed_eod_mask and not d.create_attention_mask
        if not (m.use_attn_mask_compression or eod_ok):
            raise ValueError(
                "Context parallel (context_parallel > 1) requires a compressed attention mask. Please enable "
                "use_attn_mask_compression for non-eod data, or create_compressed_eod_mask for eod data. "
                "(create_compressed_eod_mask goes with create_attention_mask: false.)"
            )
    return ulysses


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def _stage_layers(p: ParallelismConfig, m: ModelFacts, pp: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    spec = p.pipeline_parallel_layers_per_stage
    layers = m.num_hidden_layers
    if spec is None:
        raise ValueError(
            "pipeline_parallel > 1 needs pipeline_parallel_layers_per_stage: 'auto' or a list of layer ranges per stage"
        )
    if layers is None:
        raise ValueError("pipeline_parallel_layers_per_stage needs model.num_hidden_layers to place layers")
    if spec == "auto":
        if layers % virtual != 0:
            raise ValueError(
                f"pipeline_parallel_layers_per_stage auto needs num_hidden_layers ({layers}) divisible by "
                f"pipeline_parallel*interleave_num ({virtual}); list each stage's layer ranges explicitly instead"
            )
        per = layers // virtual
        return tuple(tuple(range(v * per, (v + 1) * per)) for v in range(virtual))
    if not isinstance(spec, list) or len(spec) != pp:
        raise ValueError(
            f"pipeline_parallel_layers_per_stage must be 'auto' or a list of {pp} entries (one per stage), got {spec!r}"
        )
    interleave = p.pipeline_parallel_interleave_num
    by_virtual: dict[int, tuple[int, ...]] = {}
    for stage, entry in enumerate(spec):
        segments = str(entry).split(",")
        if len(segments) != interleave:
            raise ValueError(
                f"pipeline_parallel_layers_per_stage[{stage}] = {entry!r} has {len(segments)} range(s); "
                f"it needs pipeline_parallel_interleave_num = {interleave}"
            )
        for k, seg in enumerate(segments):
            match = _RANGE.match(seg)
            if match is None:
                raise ValueError(f"pipeline_parallel_layers_per_stage[{stage}]: {seg.strip()!r} is not 'n' or 'start-end'")
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) is not None else start
            if end < start:
                raise ValueError(f"pipeline_parallel_layers_per_stage[{stage}]: range {seg.strip()!r} ends before it starts")
            by_virtual[k * pp + stage] = tuple(range(start, end + 1))
    order = [layer for v in range(virtual) for layer in by_virtual[v]]
    if order != list(range(layers)):
        raise ValueError(
            f"pipeline_parallel_layers_per_stage must cover layers 0-{layers - 1} exactly once in increasing "
            f"order by virtual stage; got {order}"
        )
    return tuple(by_virtual[v] for v in range(virtual))
