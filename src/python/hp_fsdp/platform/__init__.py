"""``fully_shard``'s framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``FSDP`` (``hp_fsdp.primitives.FSDPPrimitives``) and
``GRAD_NORM`` (``hp_fsdp.norm_primitives.GradNormPrimitives``); everything else in ``hp_fsdp`` is
framework-neutral.
"""
