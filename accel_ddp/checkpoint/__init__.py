"""Training state on disk: save and prune, the manifest that proves a checkpoint whole, resume, final weights.

    manager.py    CheckpointManager: save (every rank calls the collective), prune, resume
    choice.py     which checkpoint a resume loads: auto's newest trusted one, or a named one once it passes its checks
    train_state.py  TrainState: what a checkpoint holds (weights, optimizer, schedule, data position, records), as one;
                  every part a Stateful (state_dict / load_state_dict)
    manifest.py   each checkpoint's marker: its files' sizes and hashes, the run it belongs to
    storage.py    where sealed checkpoints live: a local folder, or an object store (--checkpoint_dir, fsspec)
    store_calls.py  an object store's calls, each within --store_timeout; StoreError, StoreStalled, StoreFailed
    hyperparameters.py  the hyperparameters recorded with each checkpoint, and this run's winning on a resume
    weights.py    safetensors weights: the final model, a pretrained start (never unpickled)
    start.py      where_to_start: fresh, resumed, already finished or refused, decided in one place; agree_start:
                  that step, then the trackers, config.yaml and the start-up block
    async_save.py --async_checkpointing: a host snapshot at the save step, written by a thread, sealed when all are
    best.py       --metric_for_best_model, --load_best_model_at_end, --early_stopping_patience (and their eval set)

May import: util, config, lifecycle, outputs; tracking (its own layer: start.py starts the trackers).
"""
