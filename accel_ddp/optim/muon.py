"""``--optimizer muon``: Muon for the hidden matrices, AdamW for the rest, stepped together as one optimizer.

torch's Muon takes 2-D parameters only, and its docstring says why and what else to do: "Muon is an optimizer for
2D parameters of neural network hidden layers. Other parameters, such as bias, and embedding, should be optimized
by a standard method such as AdamW" (torch/optim/_muon.py). Its author keeps the embedding and the final
classifier head out too (https://kellerjordan.github.io/posts/muon/, "Empirical considerations"), as nanochat and
DeepSpeed do. So Muon gets every trainable 2-D weight except those of embeddings and of the output layer; AdamW gets
biases, norms, embeddings, the output layer and convolution kernels (4-D: torch's Muon refuses them).

``MuonWithAdamW`` is one ``torch.optim.Optimizer`` to everything that handles optimizers: Accelerate's ``prepare``
(it moves the state through ``state_dict``/``load_state_dict``), the LR schedule (its ``param_groups`` are both
optimizers' group dicts themselves, Muon's first, so one LambdaLR sets both learning rates), checkpoints (one state
dict in torch's own format, its parameter indices Muon's then AdamW's: ``optimizer.bin`` loads with
``torch.load(weights_only=True)`` like any other) and the clip-step-zero_grad of accel_ddp/step.py.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MuonSplit:
    """The trainable parameters of a model as Muon and AdamW get them."""

    matrices: list[nn.Parameter]  # hidden 2-D weights: Muon
    rest: list[nn.Parameter]  # biases, norms, embeddings, the output layer, convolution kernels: AdamW
    kinds: dict[str, int]  # what the rest is: tensors of each kind

    def describe(self) -> str:
        """The start-up block's line: who gets what, counted."""
        return (f"Muon for {len(self.matrices)} hidden matri{'ces' if len(self.matrices) != 1 else 'x'} "
                f"({_count(self.matrices)} parameters), AdamW for {self.describe_rest()}")

    def describe_rest(self) -> str:
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.kinds.items() if count)
        return f"{len(self.rest)} other tensor{'s' * (len(self.rest) != 1)} ({_count(self.rest)} parameters: {kinds})"


def muon_split(model: nn.Module) -> MuonSplit:
    """Muon's share of ``model``'s trainable parameters and AdamW's (see the module docstring).

    The output layer is a Transformers model's ``get_output_embeddings()``, else the last ``nn.Linear`` the model
    registers (the classifier of the built-in models); a weight tied to an embedding (GPT-2's head) is AdamW's.
    """
    embedded = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    embedded |= {id(p) for p in _parameters(_input_layer(model))}
    head = {id(p) for p in _parameters(_output_layer(model))}
    kinds = {"biases and norms": 0, "embeddings": 0, "output layer weights": 0, "convolution kernels": 0}
    matrices, rest = [], []
    for p in (p for p in model.parameters() if p.requires_grad):
        kind = ("biases and norms" if p.ndim < 2 else "embeddings" if id(p) in embedded
                else "output layer weights" if id(p) in head else "convolution kernels" if p.ndim > 2 else None)
        if kind is None:
            matrices.append(p)
        else:
            rest.append(p)
            kinds[kind] += 1
    return MuonSplit(matrices=matrices, rest=rest, kinds=kinds)


def _parameters(module: nn.Module | None) -> list[nn.Parameter]:
    return [] if module is None else list(module.parameters())


def _output_layer(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    found = getter() if callable(getter) else None
    if isinstance(found, nn.Module):
        return found
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else None


def _input_layer(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        found = getter() if callable(getter) else None
    except NotImplementedError:  # a Transformers model without an input embedding
        return None
    return found if isinstance(found, nn.Module) else None


def _count(params: list[nn.Parameter]) -> str:
    return f"{sum(p.numel() for p in params):,}"


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon and AdamW as one optimizer: ``step`` steps both, ``param_groups`` are both lists of groups (the same
    dicts), ``state_dict`` is torch's format over the parameters in that order.

        >>> optimizer = MuonWithAdamW(torch.optim.Muon(matrices), torch.optim.AdamW(rest), muon_split(model))
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer, split: MuonSplit):
        self.muon, self.adamw, self.split = muon, adamw, split
        # The base class's hooks and profiler wrapper; its own group is replaced by the two optimizers' at once.
        super().__init__([p for opt in (muon, adamw) for group in opt.param_groups for p in group["params"]], {})
        self._link()

    def _link(self) -> None:
        """Our groups and state are the two optimizers' (again after a load, which replaces their dicts)."""
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self.state = ChainMap(self.muon.state, self.adamw.state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "param_groups", None):  # the base constructor's one group is the only one it adds
            raise NotImplementedError("MuonWithAdamW: add the group to its .muon or .adamw optimizer")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's format: ``state`` by parameter index and ``param_groups`` holding the indices, Muon's parameters
        numbered first (0..m-1), AdamW's after them."""
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        offset = 0
        for opt in (self.muon, self.adamw):
            saved = opt.state_dict()
            merged["state"].update({offset + index: value for index, value in saved["state"].items()})
            merged["param_groups"] += [{**group, "params": [offset + i for i in group["params"]]}
                                       for group in saved["param_groups"]]
            offset += sum(len(group["params"]) for group in opt.param_groups)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of ``state_dict``: each optimizer gets its groups and their state, renumbered from 0."""
        groups = state_dict["param_groups"]
        first = len(self.muon.param_groups)
        if len(groups) != first + len(self.adamw.param_groups):
            raise ValueError(f"MuonWithAdamW: the state holds {len(groups)} parameter groups, this optimizer "
                             f"{first + len(self.adamw.param_groups)}")
        offset = 0
        for opt, own in ((self.muon, groups[:first]), (self.adamw, groups[first:])):
            indices = {i for group in own for i in group["params"]}
            opt.load_state_dict({
                "state": {i - offset: value for i, value in state_dict["state"].items() if i in indices},
                "param_groups": [{**group, "params": [i - offset for i in group["params"]]} for group in own],
            })
            offset += len(indices)
        self._link()
