"""What the tests share, in one place; test modules import from here and never from each other.

    env         imported first (by conftest.py): hides the GPUs and sets the thread and offline variables
                before torch loads
    multiproc   ``run_ranks``: a function on N forked ranks of a real gloo group
    runs        real launches (``launch``, ``run_single``), ``train_ranks``/``main_ranks`` on forked ranks,
                reading a run back (``read_summary``, ``read_metrics``, ``load_weights``)
    ranks       forked ranks run as torchrun runs its workers (error files, the agent's SIGTERM)
    faults      fault injection (``install``), also read by tests/scripts/faulty_train.py
    data        datasets and models importable as ``tests.helpers.data:NAME`` (the user-code path), data files
    text        a tiny GPT-2, token sequences, a word tokenizer (for the text tasks)
    checkpoints comparing runs' weights and checkpoints, watching a launched run
    output      reading what a run printed (error lines, PNG sizes, metric series)
    anomaly     the --on_anomaly fault (a nan batch at step K on one rank) and the fused optimizers' skipped step

Fixtures live in tests/conftest.py. This package imports no test module.
"""
