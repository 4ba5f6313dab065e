"""The run folder: its names and layout, the lock and the fresh/resume checks, crash-safe file steps, the metrics
file's format, the model card.

    names.py         every file and folder name under --output_dir
    files.py         fsyncs, hashes, moves out of the way; a failed write explained in one line
    metrics_file.py  reading metrics.jsonl back (the one place that knows its format)
    run_dir.py       the lock, and whether a folder may be started, resumed or is finished
    trained.py       a finished run or one of its checkpoints found on disk, its config read back (evaluate, predict)
    model_card.py    README.md of a finished run

May import: util, config, lifecycle.
"""
