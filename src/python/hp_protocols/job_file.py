"""Which parts of a whole MindFormers job file the parallelism config reads, and which it ignores.

A MindFormers job file holds many sections (``model``, ``train_dataset``, ``training``,
``parallelism``, ``optimizer``, ``lr_schedule``, ``context``, ``callbacks``, ``checkpoint``, the
static-graph ``runner_config`` ...).  The rule, fail closed on typos:

- ``parallelism`` (and ``activation_checkpoint``) is read whole: every key must be one of its fields (a misspelt key raises,
  naming it and the nearest field).  ``sequence_parallel`` is refused: sequence parallelism
  follows ``tensor_parallel`` and has no switch.
- ``training`` is read whole too: a key must be a field read here or one MindFormers defines for
  this section (``steps``, ``max_norm``, ``seed``, ``deterministic``: named as ignored); any other
  key raises.
- ``optimizer`` and ``lr_schedule`` (or ``lr_scheduler``, as dynamic-graph files name it:
  MindFormers' AdamW and learning-rate schedule) are read
  for the keys ``hp_protocols.optimizer_file`` maps onto ``training:`` fields; any other key
  raises, naming the nearest known one.  Their values join ``training``.
- ``model`` and ``train_dataset`` describe the model and the data pipeline, which the trainer
  takes elsewhere: only the facts the rules need are read (``num_attention_heads``,
  ``num_hidden_layers``, ``use_attn_mask_compression``, directly under ``model:`` as the
  dynamic-graph files write them or under ``model.model_config:`` as the static-graph ones do;
  ``train_dataset.dataloader.config``'s ``create_compressed_eod_mask`` and
  ``create_attention_mask``).  Their other keys are named as ignored, except a key spelt almost
  like a read one (``use_attn_mask_compresion``), which raises: ignoring it would silently drop
  the setting it was meant to be.
- Every other top-level section is named as ignored, except one spelt almost like a read section
  (``parallelsim``), which raises for the same reason.

``split_job_file`` returns the read parts in one canonical layout (the four sections, model facts
flat, the optimizer's and schedule's settings as ``training`` fields) and the dotted names of
everything ignored, for the caller to print once.  Pure.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hp_protocols.optimizer_file import LR_SCHEDULE_KEYS, OPTIMIZER_KEYS, merge_into_training, training_fields

# (``lr_schedule`` as the static-graph files name it, ``lr_scheduler`` as the dynamic-graph ones do)
SCHEDULE_SECTIONS = ("lr_schedule", "lr_scheduler")
READ_SECTIONS = ("parallelism", "training", "model", "train_dataset", "activation_checkpoint", "optimizer",
                 *SCHEDULE_SECTIONS)
# keys MindFormers defines in ``training`` that this trainer does not read (flags set them here)
MINDFORMERS_TRAINING_KEYS = frozenset({"steps", "max_norm", "seed", "deterministic"})
MODEL_FACTS = ("num_attention_heads", "num_hidden_layers", "use_attn_mask_compression")
# the static-graph model_config names of the same facts
MODEL_FACT_ALIASES = {"num_heads": "num_attention_heads", "num_layers": "num_hidden_layers"}
DATA_FACTS = ("create_compressed_eod_mask", "create_attention_mask")
# MindFormers keys spelt close to a read key: real settings, not typos
_CLOSE_BUT_KNOWN = frozenset({"use_eod_attn_mask_compression", "reset_attention_mask"})
_NEAR = 0.85  # difflib ratio from which an unread key counts as a misspelling of a read one


@dataclass(frozen=True)
class JobFileParts:
    """The parts of a job file the config reads, canonical, and what it ignores."""

    parallelism: dict[str, Any]
    training: dict[str, Any]
    model: dict[str, Any]  # the facts, flat
    data: dict[str, Any]  # train_dataset.dataloader.config's flags
    ignored: tuple[str, ...]  # dotted names of ignored sections and keys, sorted
    activation_checkpoint: dict[str, Any] = field(default_factory=dict)

    def canonical(self) -> dict[str, Any]:
        """The read parts as a job mapping that ``split_job_file`` reads back unchanged."""
        out: dict[str, Any] = {"parallelism": dict(self.parallelism), "training": dict(self.training),
                               "model": dict(self.model)}
        if self.data:
            out["train_dataset"] = {"dataloader": {"config": dict(self.data)}}
        if self.activation_checkpoint:
            out["activation_checkpoint"] = dict(self.activation_checkpoint)
        return out


def split_job_file(raw: Mapping[str, Any], parallelism_keys: Iterable[str],
                   training_keys: Iterable[str], activation_checkpoint_keys: Iterable[str] = ()) -> JobFileParts:
    """Split ``raw`` (a whole job file's mapping) by the rule above; ``parallelism_keys``,
    ``training_keys`` and ``activation_checkpoint_keys`` are the fields those sections may hold.  ``ValueError`` names a misspelt or
    refused key and where it is."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"a job config must be a mapping, got {type(raw).__name__}")
    ignored: list[str] = []
    for name in raw:
        if name not in READ_SECTIONS:
            _refuse_near_miss(str(name), READ_SECTIONS, "section", "the top level")
            ignored.append(str(name))
    par = _section(raw, "parallelism")
    if "sequence_parallel" in par:
        raise ValueError(
            f"parallelism.sequence_parallel ({par['sequence_parallel']!r}) is not a setting: sequence parallelism "
            f"follows tensor_parallel (on whenever tensor_parallel > 1) and cannot be switched on or off alone; "
            f"remove the key"
        )
    _strict(par, set(parallelism_keys), frozenset(), "parallelism")
    train = _section(raw, "training")
    read_training = set(training_keys)
    _strict(train, read_training, MINDFORMERS_TRAINING_KEYS, "training")
    ignored += [f"training.{k}" for k in train if k not in read_training]
    optimizer = _section(raw, "optimizer")
    _strict(optimizer, set(OPTIMIZER_KEYS), frozenset(), "optimizer")
    given = [name for name in SCHEDULE_SECTIONS if raw.get(name) is not None]
    if len(given) > 1:
        raise ValueError(f"the job has both {given[0]}: and {given[1]}: (two names of one section); keep one")
    schedule = _section(raw, given[0]) if given else {}
    if given:
        _strict(schedule, set(LR_SCHEDULE_KEYS), frozenset(), given[0])
    training = {k: v for k, v in train.items() if k in read_training}
    merge_into_training(training, training_fields(optimizer, schedule))
    ac = _section(raw, "activation_checkpoint")
    _strict(ac, set(activation_checkpoint_keys), frozenset(), "activation_checkpoint")
    model, model_ignored = _model_facts(_section(raw, "model"))
    data, data_ignored = _data_facts(_section(raw, "train_dataset"))
    return JobFileParts(
        parallelism=dict(par), training=training,
        model=model, data=data, ignored=tuple(sorted(ignored + model_ignored + data_ignored)),
        activation_checkpoint=dict(ac),
    )


def _section(raw: Mapping[str, Any], name: str, where: str = "") -> Mapping[str, Any]:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"section {where + name!r} must be a mapping, got {type(value).__name__}")
    return value


def _closest(key: str, known: Iterable[str]) -> str | None:
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=_NEAR)
    return match[0] if match else None


def _strict(section: Mapping[str, Any], read: set[str], also_known: frozenset[str], name: str) -> None:
    unknown = sorted(str(k) for k in section if k not in read and k not in also_known)
    if unknown:
        hints = [f"{k!r} (did you mean {c!r}?)" if (c := _closest(k, read)) else repr(k) for k in unknown]
        raise ValueError(f"unknown key(s) {', '.join(hints)} in {name}; known keys are {sorted(read | also_known)}")


def _refuse_near_miss(key: str, read: Iterable[str], kind: str, where: str) -> None:
    if key in _CLOSE_BUT_KNOWN:
        return
    close = _closest(key, read)
    if close is not None and close != key:
        raise ValueError(
            f"unknown {kind} {key!r} in {where}: did you mean {close!r}? (it would be ignored, and the setting with "
            f"it; fix the spelling)"
        )


def _model_facts(model: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The model facts from ``model:`` and ``model.model_config:``; the other keys as ignored."""
    facts: dict[str, Any] = {}
    ignored: list[str] = []
    nested = _section(model, "model_config", "model.")
    for where, mapping in (("model.", model), ("model.model_config.", nested)):
        for key, value in mapping.items():
            if where == "model." and key == "model_config":
                continue
            fact = MODEL_FACT_ALIASES.get(key, key)
            if fact not in MODEL_FACTS:
                _refuse_near_miss(str(key), MODEL_FACTS, "key", where.rstrip("."))
                ignored.append(where + str(key))
                continue
            if fact in facts and facts[fact] != value:
                raise ValueError(
                    f"the job gives {fact} twice with different values ({facts[fact]!r} and {where}{key} = {value!r}); "
                    f"keep one"
                )
            facts[fact] = value
    return facts, ignored


def _data_facts(dataset: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``train_dataset.dataloader.config``'s mask flags; every other key of the data set as ignored."""
    ignored = [f"train_dataset.{k}" for k in dataset if k != "dataloader"]
    loader = _section(dataset, "dataloader", "train_dataset.")
    ignored += [f"train_dataset.dataloader.{k}" for k in loader if k != "config"]
    config = _section(loader, "config", "train_dataset.dataloader.")
    data: dict[str, Any] = {}
    for key, value in config.items():
        if key in DATA_FACTS:
            data[key] = value
        else:
            _refuse_near_miss(str(key), DATA_FACTS, "key", "train_dataset.dataloader.config")
            ignored.append(f"train_dataset.dataloader.config.{key}")
    return data, ignored


def describe_ignored(ignored: Iterable[str]) -> str:
    """One line naming what a job file holds that is not read: whole sections, then the keys of
    each partly read section grouped under it."""
    groups: dict[str, list[str]] = {}
    for name in ignored:
        parent, _, key = name.rpartition(".")
        groups.setdefault(parent, []).append(key)
    parts = [f"section(s) {', '.join(groups.pop(''))}"] if "" in groups else []
    parts += [f"{parent}: {', '.join(keys)}" for parent, keys in groups.items()]
    return "not read by this trainer, ignored: " + "; ".join(parts)
