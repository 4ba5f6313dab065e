"""One optimizer step on this rank, as cheap on the host as the math allows.

    update.py      the backward and the update (clip, step, zero_grad) without Accelerate's per-call work where it
                   adds nothing (``build_update``, ``build_backward``)
    losses.py      ``LossAccumulator``: each micro-step's loss backpropagated, a ``(sum, num_items)`` pair made
                   token-exact over the global batch, the logged running loss
    train_step.py  ``TrainStep``: forward, loss, backward, and at the step's last micro-step rescale, clip, update
    graph.py       ``--cuda_graphs``: when a step can be captured (``refuse_graphs``), the capture and its replays

May import: util, tasks (and the layers below them).
"""
