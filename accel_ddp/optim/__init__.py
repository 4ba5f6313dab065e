"""The optimizer and the learning-rate schedule a run steps.

    build.py   any ``torch.optim`` class by name (``--optimizer``, ``--optimizer_kwargs``) or a user's function of the
               parameter groups; the weight-decay groups, fused or multi-tensor kernels; the LR schedules
    muon.py    ``--optimizer muon``: the hidden matrices to Muon, the rest to AdamW, as one optimizer
    user.py    the run's optimizer and schedule whoever makes them (the flags or ``train(optimizer=, lr_scheduler=)``),
               checked before any data is read

``build.py`` and ``muon.py`` import torch and util only (benchmarks/bare_ddp.py builds its optimizer with them,
without Accelerate).

May import: util, config.
"""
