"""How a batch reaches the model, the loss, the eval statistics; a user's own loss and collate code, guarded.

    protocol.py   the Task protocol and the built-in tasks (classification, token tasks), the loss contract
    chunked_loss.py  --chunked_loss: the causal-LM loss from hidden states in chunks (no full fp32 logits)
    batches.py    what a batch and a model's outputs hold (labels, own loss, forward's arguments, device)
    labels.py     labels checked against the model's classes, on the host, once
    finite.py     nan or inf inputs of the sets held in memory and of the probe's batch, named at start-up
    probe.py      one batch through the model at start-up: a wrong task, shape or label fails before training
    user_code.py  a user's collate_fn / loss_fn / metrics: called, checked, named in the error line
    arguments.py  train()'s arguments checked at the door: an nn.Module, datasets of samples

May import: util, config, lifecycle, data.
"""
