"""The model's transforms before DDP wraps it, each a ``ModelConverter`` (``util/converters.py``) in the module that
owns its feature; ``assemble.MODEL_CONVERTERS`` is their one ordered list (the task's own, ``CHANNELS_LAST`` and
``CHUNKED_LOSS``, live in ``tasks/``).

    finetune.py           ``INIT_FROM`` (``--init_from``), ``GRADIENT_CHECKPOINTING``, ``PEFT`` (LoRA adapters on a
                          frozen base); the base's fingerprint, the adapter's export
    fused_activations.py  ``FUSED_KERNELS`` (``--fused_kernels``): Transformers' Python tanh GELUs as torch's one kernel
    regional_compile.py   ``COMPILE_REGIONS`` (``--compile_regions``): each repeated block compiled in place

May import: util, config, lifecycle, outputs, checkpoint.
"""
