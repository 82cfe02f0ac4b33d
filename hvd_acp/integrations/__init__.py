"""ACP-SGD in the training frameworks PyTorch users train with.

Each module imports its framework only when imported itself:

- :mod:`hvd_acp.integrations.lightning`: ``ACPCallback``, a PyTorch
  Lightning callback for ``strategy="ddp"``;
- :mod:`hvd_acp.integrations.accelerate`: ``register_acp(accelerator, model,
  optimizer)``, one call after ``accelerator.prepare(...)``;
- :mod:`hvd_acp.integrations.transformers`: ``register_acp(trainer)``, one
  call after building a Hugging Face ``Trainer``.

All three register :func:`hvd_acp.ddp.acp_hook` on the
``DistributedDataParallel`` module the framework built, hand the optimizer
to the hook's :class:`~hvd_acp.ddp.ACPState` (step-ahead error feedback on,
as in ``hvd_acp.DistributedOptimizer``), keep the compression state in the
framework's own checkpoints, and raise where the framework trains without a
DDP module (FSDP, DeepSpeed, a single process).
"""
