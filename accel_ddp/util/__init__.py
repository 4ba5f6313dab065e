"""Leaf helpers every layer may use: value checks and the error types, the registry, optional packages, the one
crash-safe write, and the messages module (warnings, notes, error lines, which rank prints).

    validation.py   ConfigError / LaunchError and the value checks behind every "accel_ddp: error:" line
    messages.py     every console line: warning, note, error, what the run does (say), first_line; which rank
                    prints it
    ranks.py        who is rank 0 before the process group exists: the launcher's RANK/WORLD_SIZE (or MPI's)
    registry.py     name -> builder lookup, ``pkg.module:function`` for a user's own
    optional.py     an optional package, or one line naming the pip install
    atomic.py       atomic_write_text: readers see the old file or the new, never half
    yaml_text.py    dump/load: YAML through libyaml where PyYAML has it (config.yaml), PyYAML's own code else
    model_outputs.py  logits_of: a model's logits, whatever it returns
    host_memory.py  keep_freed_host_memory: glibc keeps a CPU step's freed memory for the next step
    cpu_bf16.py     the CPU's bf16 units and the one verdict on bf16 autocast there (doctor and start-up block)
    precision.py    autocast_dtype: the dtype Accelerate's mixed_precision computes in, the one map
    converters.py   ModelConverter: one transform of a built model (its section of the options, its check, its
                    start-up line); convert_model

May import: nothing from accel_ddp (the standard library; torch and Accelerate only inside a function).
"""
