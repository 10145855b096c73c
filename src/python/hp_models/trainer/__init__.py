"""The trainer behind ``python -m hp_models.train``, one component per module, found by name:

- ``args``: the command line (``Args``, ``parse_args``);
- ``backend``: the framework that trains (``--backend``) and what the MindSpore backend refuses;
- ``checks``: the model config and the layout, and everything refused before any rank starts;
- ``parallelize``: the model built and parallelized in the one composition order (pipeline split,
  then TP with SP, then CP, then FSDP/HSDP; the MoE, CP and PP paths in ``hp_models.train_moe``,
  ``hp_models.train_context`` and ``hp_models.train_pipeline``);
- ``data``: the global batch of each step;
- ``step``: one optimizer step's forwards and backwards (the loss over the global batch);
- ``optimizer`` and ``lr_schedule``: AdamW and the learning rate of each step;
- ``grad_norm``: the gradients' global norm over every mesh dim, and clipping by it;
- ``checkpointing``: the run's settings and the checkpoint directory's checks (the state itself:
  ``hp_models.train_checkpoint`` on torch); ``resume``: which checkpoint a resume continues and
  whether it is this run's (framework-neutral); ``shards_checkpoint``: the safetensors-shards
  layout of the trainer's state both backends write and resume;
- ``metrics`` and ``tensorboard``: the progress bar, the per-step metrics and their event files;
- ``loop``: the training loop on one rank; ``spawn``: the ranks (``hp_models.launch``);
- ``outputs``: ``log.json``, ``loss.png`` and the summary;
- ``mindspore``: the MindSpore backend (its model, step, AdamW, checkpoint, loop and msrun-style ranks).
"""
