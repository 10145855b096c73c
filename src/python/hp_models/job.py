"""How a training run is laid out over ranks: a job file's ``parallelism:`` and ``training:``
sections, overridden by command-line flags, resolved into the numbers the trainer uses.  The job
file may be a whole MindFormers file: ``read_job`` keeps what is read (``hp_protocols.job_file``
has the rule) and names the rest, for the launcher to print once.

Pure (no framework): it reads YAML and calls ``hp_protocols``' ``JobConfig.resolve``, which checks
every rule of the parallelism config.  On top of those rules it refuses what the trainer cannot do
yet (for expert parallelism see ``hp_models.job_moe``), a pipeline split or microbatch count the
schedules cannot run (with ``hp_pp``'s messages), and a global batch that the data-parallel ranks
and accumulation steps would not consume exactly, so no run trains on a batch other than the one
asked for.  Under pipeline parallelism the accumulation
steps are the microbatches.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from hp_cp.config import ContextParallelConfig, CPMethod, MaskCompression
from hp_models.job_moe import MoeSettings, check_moe_job
from hp_pp import StageSplit, split_layers
from hp_protocols import ActivationCheckpointConfig, ActivationCheckpointMode, FloatDType, JobConfig, LRDecay
from hp_protocols.job_file import describe_ignored
from hp_protocols.parallelism import ParallelDims, TrainingConfig, job_file_parts

DEFAULT_GLOBAL_BATCH_SIZE = 8
DEFAULT_TP = 2  # without a job file: the README's main job
DEFAULT_LR = 3e-3  # the peak learning rate without --lr or a job file's learning_rate

@dataclass(frozen=True)
class Overrides:
    """Command-line values that replace the job file's (None: keep the file's, or the default)."""

    tp: int | None = None
    dp_shard: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    global_batch_size: int | None = None
    local_batch_size: int | None = None
    activation_checkpoint: ActivationCheckpointMode | None = None  # --activation-checkpoint
    ac_every: int | None = None  # --ac-every: selective_ac_option
    param_dtype: FloatDType | None = None  # --mixed-precision (bf16: bfloat16, none: float32)
    lr: float | None = None  # --lr: the job's learning_rate
    lr_warmup_steps: int | None = None
    lr_decay: str | None = None
    lr_decay_steps: int | None = None
    lr_min: float | None = None
    max_grad_norm: float | None = None


# (the ``training:`` fields of the schedule and clipping, which the flags of the same name override)
_OPTIM_FIELDS = ("lr_warmup_steps", "lr_decay", "lr_decay_steps", "lr_min", "max_grad_norm")


@dataclass(frozen=True)
class OptimSettings:
    """The job's learning-rate schedule, gradient clipping and AdamW settings (validated; see
    ``TrainingConfig``)."""

    warmup_steps: int = 0
    decay: LRDecay = LRDecay.NONE
    decay_steps: int | None = None  # None: from the end of the warmup to the end of the run
    lr_min: float = 0.0
    max_grad_norm: float | None = None  # None: the gradients are not clipped
    lr: float = DEFAULT_LR  # the peak learning rate
    warmup_ratio: float | None = None  # the warmup as a share of the run's steps (instead of warmup_steps)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @classmethod
    def of(cls, t: TrainingConfig) -> OptimSettings:
        return cls(warmup_steps=t.lr_warmup_steps, decay=LRDecay.parse(t.lr_decay), decay_steps=t.lr_decay_steps,
                   lr_min=float(t.lr_min), max_grad_norm=None if t.max_grad_norm is None else float(t.max_grad_norm),
                   lr=DEFAULT_LR if t.learning_rate is None else float(t.learning_rate),
                   warmup_ratio=None if t.lr_warmup_ratio is None else float(t.lr_warmup_ratio),
                   betas=(float(t.adam_betas[0]), float(t.adam_betas[1])), eps=float(t.adam_eps),
                   weight_decay=float(t.weight_decay))


@dataclass(frozen=True)
class ModelSizes:
    """What the parallelism rules need to know about the model actually built."""

    num_attention_heads: int
    num_hidden_layers: int
    num_experts: int | None = None  # None: a dense model


@dataclass(frozen=True)
class TrainLayout:
    """A validated layout: derived sizes, batch sizes and the data-parallel gradient policy."""

    dims: ParallelDims
    global_batch_size: int
    local_batch_size: int
    sum_gradients: bool  # disable_gradient_division: data-parallel gradients are summed, not averaged
    cpu_offload: bool
    reshard_after_forward_policy: str
    split: StageSplit | None = None  # the layers of each virtual stage, under pipeline parallelism
    overlap_p2p: bool = False
    # context parallelism's method and mask compression (degree 1: none; EOD compression: the
    # data are packed documents, also without context parallelism)
    context: ContextParallelConfig = ContextParallelConfig(compression=MaskCompression.NONE)
    moe: MoeSettings | None = None  # a mixture-of-experts model's expert-parallel settings
    # trainer features (hp_models.activation_checkpoint, hp_models.mixed_precision)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    param_dtype: FloatDType = FloatDType.FLOAT32
    reduce_dtype: FloatDType = FloatDType.FLOAT32
    optim: OptimSettings = OptimSettings()  # learning-rate schedule and gradient clipping

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def interleave(self) -> int:
        return self.split.interleave if self.split is not None else 1

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas times shards): how many ways each step's batch is split."""
        return self.dims.data_parallel

    @property
    def accumulation(self) -> int:
        assert self.dims.num_accumulation_steps is not None
        return self.dims.num_accumulation_steps

    @property
    def uses_fsdp(self) -> bool:
        """Gradients must be combined across data-parallel ranks: ``fully_shard`` does it (HSDP with
        a shard group of one rank when only ``dp_replicate`` > 1); under context parallelism the
        CP ranks shard the parameters too (the shard group is ``dp_shard * cp``)."""
        return self.dp > 1 or self.cp > 1

    def loss_scale(self) -> float:
        """The factor each micro-step's mean loss is multiplied by before backward, so that the
        gradients after the data-parallel reduction and the accumulation equal those of the mean
        loss over the whole global batch on one process.

        Accumulation adds ``accumulation`` micro-step gradients.  With ``sum_gradients`` the
        reduction adds the gradients of every data-parallel rank, so the loss is also divided by
        their number, the ranks that each computed a loss on their own samples.  (The ranks of one
        tensor-parallel group share a single loss, a replicated DTensor whose backward already
        gives every rank its exact gradient, so they are not counted again.)  Without
        ``sum_gradients`` ``fully_shard`` averages over those ranks itself."""
        ranks = self.dp if self.sum_gradients and self.uses_fsdp else 1
        return 1.0 / (ranks * self.accumulation)

    def samples(self, dp_rank: int, micro_step: int) -> slice:
        """The rows of the step's global batch that data-parallel rank ``dp_rank`` consumes in
        ``micro_step``: every (micro-step, rank) pair gets its own ``local_batch_size`` rows."""
        if not 0 <= dp_rank < self.dp or not 0 <= micro_step < self.accumulation:
            raise ValueError(f"dp_rank {dp_rank} / micro_step {micro_step} out of range for {self.dp} x {self.accumulation}")
        start = (micro_step * self.dp + dp_rank) * self.local_batch_size
        return slice(start, start + self.local_batch_size)

    def describe(self) -> str:
        d = self.dims
        pp = [f"pp={d.pp}" + (f" x interleave {self.interleave}" if self.interleave > 1 else "")] if d.pp > 1 else []
        c = self.context
        cp = [f"cp={d.cp} {c.method.value}" + (f" (ulysses {d.ulysses_degree})" if c.method is CPMethod.HYBRID else "")
              ] if d.cp > 1 else []
        ep = [f"ep={d.ep}"] if d.ep > 1 else []
        if self.dp == 1 and not pp and not cp and not ep:
            return f"tp={d.tp}"
        dp = ([f"dp_replicate={d.dp_replicate}"] if d.dp_replicate > 1 else []) + (
            [f"dp_shard={d.dp_shard}"] if self.dp > 1 else [])
        return f"{', '.join(pp + dp + cp + ep + [f'tp={d.tp}'])} on {d.world_size} ranks"

    def as_dict(self) -> dict[str, Any]:
        d = self.dims
        out: dict[str, Any] = {
            "world_size": d.world_size, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp,
            "global_batch_size": self.global_batch_size, "local_batch_size": self.local_batch_size,
            "accumulation_steps": self.accumulation, "sum_gradients": self.sum_gradients,
            "reshard_after_forward": d.reshard_after_forward,
        }
        if d.pp > 1:  # (a layout without pipelining reads as before)
            out.update({"pp": d.pp, "interleave": self.interleave,
                        "stage_layers": [list(layers) for layers in self.split.layers] if self.split else None})
        if d.cp > 1:
            out.update({"cp": d.cp, "cp_method": self.context.method.value, "ulysses_degree": d.ulysses_degree})
        if d.ep > 1:
            out.update({"ep": d.ep, "efsdp": d.efsdp})
        if self.moe is not None and self.moe.etp > 1:  # experts keep part of their TP split
            out.update({"etp": self.moe.etp, "edp": self.moe.edp})
        ac = self.activation_checkpoint
        if ac.mode is not ActivationCheckpointMode.NONE:
            out["activation_checkpoint"] = ac.mode.value + (f" every {ac.every}" if ac.mode is
                                                            ActivationCheckpointMode.SELECTIVE else "")
        if self.param_dtype is not FloatDType.FLOAT32 or self.reduce_dtype is not FloatDType.FLOAT32:
            out.update({"param_dtype": self.param_dtype.value, "reduce_dtype": self.reduce_dtype.value})
        return out


@dataclass(frozen=True)
class JobFile:
    """A job file read: the parts the trainer reads, canonical, and what it ignores."""

    path: str
    raw: dict[str, Any]  # parallelism / training / model facts / train_dataset flags
    ignored: tuple[str, ...]  # dotted names of the sections and keys not read

    def note(self) -> str | None:
        """The one line naming what is ignored (None when nothing is)."""
        if not self.ignored:
            return None
        return f"note: job file {self.path}: {describe_ignored(self.ignored)}"

    def announce(self) -> None:
        """Print ``note()`` once per job: by the launcher, or by rank 0 under ``torchrun``."""
        line = self.note()
        if line is not None and os.environ.get("RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)


def read_job(path: str) -> JobFile:
    """A YAML job file, whole MindFormers files included: ``ValueError`` when it is missing, not a
    mapping, or misspells a key that is read (``hp_protocols.job_file`` has the rule)."""
    whole = _load_yaml(path)
    try:
        parts = job_file_parts(whole)
    except ValueError as e:
        raise ValueError(f"job file {path}: {e}") from None
    return JobFile(path=path, raw=parts.canonical(), ignored=parts.ignored)


def read_job_file(path: str) -> dict[str, Any]:
    """The parts of a YAML job file the trainer reads, as a canonical mapping (see ``read_job``)."""
    return read_job(path).raw


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"job file {path!r} does not exist")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"job file {path!r} is not valid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"job file {path!r} must be a mapping with parallelism: and training: sections")
    return raw


def plan(
    raw: dict[str, Any] | None, overrides: Overrides, model: ModelSizes, world_size: int | None = None
) -> TrainLayout:
    """Resolve a job (``raw``: the job file's mapping, None without one) with ``overrides`` for
    ``world_size`` ranks (None: the ranks the job names, i.e. ``data_parallel_shard * tp * pp`` with
    no replicas, or ``tp * pp`` when ``data_parallel_shard`` is -1).  Without ``local_batch_size``
    each data-parallel rank takes its share of the batch in one micro-step, or in ``pp``
    microbatches under pipeline parallelism when they divide it.  Raises ``ValueError`` (a
    ``PipelineConfigError`` for a layer split) saying what to change."""
    # the parts of a (whole MindFormers) job file that are read, canonical: model facts flat
    job = copy.deepcopy(job_file_parts(raw).canonical()) if raw is not None else {}
    par = dict(job.get("parallelism") or {})
    train = dict(job.get("training") or {})
    if raw is None and overrides.tp is None:
        par["tensor_parallel"] = DEFAULT_TP
    if overrides.tp is not None:
        par["tensor_parallel"] = overrides.tp
    if overrides.dp_shard is not None:
        par["data_parallel_shard"] = overrides.dp_shard
    if overrides.cp is not None:
        par["context_parallel"] = overrides.cp
    if overrides.pp is not None:
        par["pipeline_parallel"] = overrides.pp
        if overrides.pp > 1:
            par.setdefault("pipeline_parallel_layers_per_stage", "auto")
    if overrides.ep is not None:
        par["expert_parallel"] = overrides.ep
    if overrides.global_batch_size is not None:
        train["global_batch_size"] = overrides.global_batch_size
    if overrides.local_batch_size is not None:
        train["local_batch_size"] = overrides.local_batch_size
    for name in _OPTIM_FIELDS:
        if getattr(overrides, name) is not None:
            train[name] = getattr(overrides, name)
    if overrides.lr_warmup_steps is not None:
        train.pop("lr_warmup_ratio", None)  # the flag sets the warmup, whichever way the job gave it
    if overrides.lr is not None:
        train["learning_rate"] = overrides.lr
    train.setdefault("global_batch_size", DEFAULT_GLOBAL_BATCH_SIZE)
    if overrides.param_dtype is not None:
        train["param_dtype"] = overrides.param_dtype.value
        if overrides.param_dtype is FloatDType.FLOAT32:  # --mixed-precision none: float32 everywhere
            train["reduce_dtype"] = FloatDType.FLOAT32.value
    job["activation_checkpoint"] = _ac_section(job.get("activation_checkpoint"), overrides)
    job["parallelism"], job["training"] = par, train
    job["model"] = _model_facts(dict(job.get("model") or {}), model)

    config = JobConfig.from_dict(job)  # unknown keys and wrong types fail here, naming them
    p = config.parallelism
    split = None
    if isinstance(p.pipeline_parallel, int) and p.pipeline_parallel > 1:
        # hp_pp's split: its messages suggest the explicit form when ``auto`` cannot divide
        split = split_layers(p.pipeline_parallel_layers_per_stage, model.num_hidden_layers, p.pipeline_parallel,
                             p.pipeline_parallel_interleave_num)
    model_ranks = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    if world_size is None:
        shard = p.data_parallel_shard
        world_size = model_ranks * (shard if isinstance(shard, int) and shard > 0 else 1)
    if "local_batch_size" not in train:
        # No accumulation unless asked for: each data-parallel rank takes its share of the batch;
        # under pipeline parallelism the microbatches are the accumulation steps: one per pp rank.
        data_parallel = world_size // model_ranks if model_ranks > 0 else 0
        if data_parallel > 0 and isinstance(config.training.global_batch_size, int):
            per_rank = config.training.global_batch_size // data_parallel
            micro = p.pipeline_parallel if per_rank % max(p.pipeline_parallel, 1) == 0 else 1
            config.training.local_batch_size = max(1, per_rank // micro)
    dims = config.resolve(world_size)
    moe = check_moe_job(p, dims, model.num_experts)
    gbs, lbs = config.training.global_batch_size, config.training.local_batch_size
    assert gbs is not None and dims.num_accumulation_steps is not None
    consumed = dims.data_parallel * lbs * dims.num_accumulation_steps
    if consumed != gbs:
        raise ValueError(
            f"global_batch_size {gbs} is not a multiple of data_parallel * local_batch_size = "
            f"{dims.data_parallel} * {lbs} = {dims.data_parallel * lbs}: a step would consume {consumed} "
            f"samples; pick sizes where it divides"
        )
    if split is not None and split.interleave > 1 and dims.num_accumulation_steps % dims.pp:
        raise ValueError(
            f"pipeline_parallel_interleave_num {split.interleave} runs the interleaved 1F1B schedule, which needs "
            f"the microbatches (accumulation steps = global_batch_size // (data_parallel * local_batch_size) = "
            f"{gbs} // ({dims.data_parallel} * {lbs}) = {dims.num_accumulation_steps}) to be a multiple of "
            f"pipeline_parallel {dims.pp}; change global_batch_size or local_batch_size"
        )
    layout = TrainLayout(
        dims=dims, global_batch_size=gbs, local_batch_size=lbs, sum_gradients=p.disable_gradient_division,
        cpu_offload=p.cpu_offload, reshard_after_forward_policy=p.reshard_after_forward_policy, split=split,
        overlap_p2p=p.pipeline_parallel_overlap_p2p, context=_context(config, dims), moe=moe,
        activation_checkpoint=config.activation_checkpoint, param_dtype=config.training.param_dtype,
        reduce_dtype=config.training.reduce_dtype,
        optim=OptimSettings.of(config.training),
    )
    _check_features(layout)
    if moe is not None and layout.context.compression is MaskCompression.EOD:
        # The dense model trains packed documents as one row each, so attention never crosses a
        # document's end; the MoE step has no such path and would train the packed rows whole,
        # attending across documents the job asked to keep apart.
        cp = f" with context_parallel={dims.cp}" if dims.cp > 1 else ""
        raise ValueError(
            f"packed documents (create_compressed_eod_mask: true){cp} are not built for the MoE model: its "
            f"attention would cross document ends; train it on ordinary sequences (create_compressed_eod_mask: "
            f"false, and model.use_attn_mask_compression: true under context parallelism)"
        )
    if moe is not None and dims.pp > 1 and layout.param_dtype is not FloatDType.FLOAT32:
        # the stages pass the router's token counts on with the hidden states, in their dtype
        raise ValueError(
            f"pipeline_parallel={dims.pp} with param_dtype {layout.param_dtype.value}: the MoE model's stages send "
            f"the router's token counts with the hidden states, exact in float32 only; train the MoE model under "
            f"pipeline parallelism in float32 (drop --mixed-precision / param_dtype)"
        )
    return layout


def _ac_section(raw: Any, overrides: Overrides) -> dict[str, Any]:
    """The job's ``activation_checkpoint:`` section with the flags applied.  ``--ac-every`` is
    the block interval of ``selective`` and means nothing under another mode: refused there."""
    if raw is not None and not isinstance(raw, dict):
        raise ValueError("the job's activation_checkpoint: section must be a mapping (mode, selective_ac_option)")
    section = dict(raw or {})
    if overrides.activation_checkpoint is not None:
        section["mode"] = overrides.activation_checkpoint.value
    if overrides.ac_every is not None:
        section["selective_ac_option"] = str(overrides.ac_every)
        mode = ActivationCheckpointMode.parse(section.get("mode", ActivationCheckpointMode.NONE.value))
        if mode is not ActivationCheckpointMode.SELECTIVE:
            raise ValueError(
                f"--ac-every {overrides.ac_every} sets the block interval of selective activation checkpointing, "
                f"but the mode is {mode.value!r}; add --activation-checkpoint selective (or drop --ac-every)"
            )
    return section


def _check_features(layout: TrainLayout) -> None:
    """Mixed precision without data-parallel sharding: refused (``fully_shard`` applies it)."""
    mixed = layout.param_dtype is not FloatDType.FLOAT32 or layout.reduce_dtype is not FloatDType.FLOAT32
    if mixed and not layout.uses_fsdp:
        raise ValueError(
            f"param_dtype {layout.param_dtype.value} / reduce_dtype {layout.reduce_dtype.value}: mixed precision is "
            f"applied by fully_shard, and this layout has no data-parallel sharding ({layout.describe()}); add "
            f"data-parallel ranks (e.g. --dp-shard 2 with --nproc = 2 * tp), or use float32 (--mixed-precision none)"
        )


def _context(config: JobConfig, dims: ParallelDims) -> ContextParallelConfig:
    """The context-parallel settings of a resolved job.  Packed documents (the data's
    ``create_compressed_eod_mask``) take the EOD mask even when the model also compresses the
    causal one: attention must not cross a document."""
    p = config.parallelism
    if config.data.create_compressed_eod_mask:
        compression = MaskCompression.EOD
    elif config.model.use_attn_mask_compression:
        compression = MaskCompression.CAUSAL
    else:
        compression = MaskCompression.NONE
    method = CPMethod.parse(p.context_parallel_method)
    return ContextParallelConfig(
        degree=dims.cp, method=method, async_comm=p.context_parallel_async,
        ulysses_degree=dims.ulysses_degree if method is not CPMethod.COLOSSAL else None,
        mask_type=p.context_parallel_mask_type, compression=compression,
    )


def _model_facts(facts: dict[str, Any], model: ModelSizes) -> dict[str, Any]:
    """The job's ``model:`` facts, filled from the model built; a fact that disagrees with it is an
    error (the rules would be checked against a model that is not the one trained)."""
    for key in ("num_attention_heads", "num_hidden_layers"):
        have = getattr(model, key)
        if key in facts and facts[key] != have:
            raise ValueError(f"the job's model.{key} is {facts[key]!r} but the model being trained has {have}")
        facts[key] = have
    return facts


def single_process(layout: TrainLayout, model: ModelSizes) -> TrainLayout:
    """The same global batch on one process, in one forward per step: the reference run.  A
    mixture-of-experts model keeps the run's forwards of ``local_batch_size`` samples instead (as
    accumulation steps, over the same rows in the same order): its router loss is a statistic of
    each forward's tokens, so a bigger forward would compute another loss."""
    g = layout.global_batch_size
    per_forward = layout.local_batch_size if model.num_experts is not None else g
    one = plan(None, Overrides(tp=1, dp_shard=1, pp=1, cp=1, ep=1, global_batch_size=g,
                               local_batch_size=per_forward), model, world_size=1)
    # the same data (packed documents stay packed, and attend within each document), the same
    # learning-rate schedule and clipping
    return replace(one, context=ContextParallelConfig(compression=layout.context.compression), optim=layout.optim)
