"""Training state on disk: save and prune, the manifest that proves a checkpoint whole, resume, final weights.

    manager.py    CheckpointManager: save (every rank calls the collective), prune, find the one to resume
    manifest.py   each checkpoint's marker: its files' sizes and hashes, the run it belongs to
    weights.py    safetensors weights: the final model, a pretrained start (never unpickled)

May import: util, lifecycle, outputs.
"""
