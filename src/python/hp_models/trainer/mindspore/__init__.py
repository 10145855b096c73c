"""The trainer's MindSpore backend (``python -m hp_models.train --backend mindspore``): the same
main job on MindSpore PyNative (mccl CPU ranks), one component per module:

- ``model``: the MindSpore Qwen3.5 with the torch trainer's seeded initial weights, tensor
  parallel through the model's ``ShardingConfig`` plan, then FSDP/HSDP over the data-parallel ranks;
- ``step``: one optimizer step's forwards and backwards through ``mindspore.value_and_grad``;
- ``optimizer``: AdamW over the parameters' local shards, torch's update written in MindSpore ops;
- ``loop``: the training loop on one rank; ``spawn``: the scheduler and worker ranks, started the
  way ``msrun`` starts them.

The framework-neutral parts (flags, checks, layout, data, learning-rate schedule, metrics,
outputs) are ``hp_models.trainer``'s; what this backend refuses is ``hp_models.trainer.backend``'s.
"""
