"""Model and optimizer state keyed by parameter name, as live objects any checkpoint manager can save.

The wrappers here go through ``torch.distributed.checkpoint.state_dict``: wrapper prefixes (DDP
``module.``, ``torch.compile``'s ``_orig_mod.``) are dropped, optimizer state is keyed by
parameter name instead of by position, and sharded parameters (FSDP2, tensor parallel) stay
DTensors, so the DCP backend writes and reads each rank's shard only. A payload built from them
survives a change of wrapping, of world size (for the sharded parts) and a round trip through DCP,
which stores every mapping key as a string.

Pass them as values of the state given to a manager's `save`, and to `load_into`:

```python
manager.save({"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "epoch": 3}, "epoch-3")
rest = manager.load_into("latest", {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)})
```
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_map

__all__ = ["ModelState", "OptimizerState", "TrainingState", "get_training_state", "set_training_state"]


def _containers_copy(state: Any) -> Any:
    # set_*_state_dict consume the mappings they are given; rebuild the containers so the
    # caller's mapping stays intact (the tensors themselves are not copied).
    return tree_map(lambda leaf: leaf, state)


def _check_module(model: Any, owner: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{owner} needs an nn.Module, got {type(model).__name__}")
    return model


class ModelState:
    """A model's weights keyed by parameter name, as a live object for checkpoint managers.

    Args:
        model: The model, possibly wrapped (DDP, `torch.compile`) or sharded (FSDP2, tensor parallel).
        strict: Whether loading requires the checkpoint's keys to match the model's exactly.

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> state = ModelState(model).state_dict()
        >>> sorted(state)
        ['bias', 'weight']
        >>> ModelState(nn.Linear(2, 1)).load_state_dict(state)
    """

    def __init__(self, model: nn.Module, *, strict: bool = True) -> None:
        self.model = _check_module(model, "ModelState")
        self.strict = bool(strict)

    def __repr__(self) -> str:
        return f"ModelState({type(self.model).__name__}, strict={self.strict})"

    def state_dict(self) -> dict[str, Any]:
        """Weights keyed by parameter name; these are the live tensors, not copies.

        A model without parameters or buffers (an activation, a parameter-free head) has the
        empty state, which DCP would refuse to export.
        """
        if self._stateless():
            return {}
        return get_model_state_dict(self.model)

    def _stateless(self) -> bool:
        return next(self.model.parameters(), None) is None and next(self.model.buffers(), None) is None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy `state_dict` into the model's parameters and buffers.

        Raises:
            ValueError: `state_dict` is empty while `strict` is set and the model has weights
                (nothing would be loaded).
        """
        if not state_dict:
            if self.strict and not self._stateless():
                raise ValueError(f"ModelState(strict=True) got no weights to load into the {type(self.model).__name__}")
            return
        options = StateDictOptions(strict=self.strict)
        set_model_state_dict(self.model, _containers_copy(dict(state_dict)), options=options)


def _like(value: Any, param: torch.Tensor, key: str) -> Any:
    """An optimizer state entry placed as torch places it on load: on the parameter's device, in its
    floating dtype; the `step` counter and non-tensor entries as they are."""
    if key == "step" or not torch.is_tensor(value):
        return value
    return value.to(param.device, param.dtype if value.is_floating_point() else value.dtype)


class OptimizerState:
    """An optimizer's state keyed by parameter name, as a live object for checkpoint managers.

    Saving an optimizer that has not stepped yet exports its parameter groups and an empty state
    instead of letting DCP initialise it with a zero-learning-rate step, which would advance
    counters such as Adam's ``step`` before training. Loading works into a fresh optimizer too.

    An optimizer may also update tensors that are not parameters of the model (a learnable loss
    temperature in the criterion, a separate head): name them in `extras`. Their state is stored
    under those names beside the model's, as plain (unsharded) tensors, and their values under
    `parameters` (no model state holds them), restored with the optimizer's state.

    Args:
        model: The model whose parameters the optimizer updates (names come from it).
        optimizer: The optimizer.
        extras: Names of the optimizer's parameters that are not in `model` (e.g. `criterion.scale`);
            a parameter in neither is an error naming its shape.

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> state = OptimizerState(model, optimizer).state_dict()
        >>> state["state"], state["param_groups"][0]["params"]
        ({}, ['weight', 'bias'])
        >>> scale = nn.Parameter(torch.ones(()))
        >>> both = torch.optim.Adam([*model.parameters(), scale])
        >>> OptimizerState(model, both, {"criterion.scale": scale}).state_dict()["param_groups"][0]["params"]
        ['weight', 'bias', 'criterion.scale']
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.model = _check_module(model, "OptimizerState")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerState needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.extras = dict(extras or {})

    def __repr__(self) -> str:
        return f"OptimizerState({type(self.optimizer).__name__})"

    def state_dict(self) -> dict[str, Any]:
        """State and parameter groups keyed by parameter name (live tensors, not copies)."""
        if self.optimizer.state:
            return self._named_state()
        groups = []
        for group, names in zip(self.optimizer.param_groups, self._group_names()):
            hyper = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyper, "params": names})
        return self._with_values({"state": {}, "param_groups": groups})

    def _with_values(self, state: dict[str, Any]) -> dict[str, Any]:
        if self.extras:
            state["parameters"] = {name: param.data for name, param in self.extras.items()}
        return state

    def _group_names(self) -> list[list[str]]:
        """The parameter names of each live parameter group."""
        names = {id(param): name for name, param in self.extras.items()}
        for name, param in self.model.named_parameters():
            names[id(param)] = next(iter(_get_fqns(self.model, name)))
        groups = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in names:
                    optimizer = type(self.optimizer).__name__
                    raise ValueError(
                        f"the {optimizer} updates a parameter of shape {tuple(param.shape)} that is "
                        "neither in the model nor named in `extras`; hold it in a module of the runner (e.g. the "
                        "criterion) or pass its name"
                    )
            groups.append([names[id(param)] for param in group["params"]])
        return groups

    def _model_view(self) -> torch.optim.Optimizer:
        """The optimizer restricted to the model's parameters: a shallow copy sharing the live tensors.

        torch's name-keyed state functions map every parameter of the optimizer to a name of the
        model and fail on any other; the extras are handled beside them by name.
        """
        if not self.extras:
            return self.optimizer
        outside = {id(param) for param in self.extras.values()}
        view = copy.copy(self.optimizer)
        # Its own state mapping, holding the model's entries (the same dicts of live tensors).
        view.state = defaultdict(dict, ((p, v) for p, v in self.optimizer.state.items() if id(p) not in outside))
        view.param_groups = [
            {**group, "params": [param for param in group["params"] if id(param) not in outside]}
            for group in self.optimizer.param_groups
        ]
        return view

    def _named_state(self) -> dict[str, Any]:
        view = self._model_view()
        state = get_optimizer_state_dict(self.model, view)
        if view is self.optimizer:
            return state
        live = self.optimizer.state
        for group, names in zip(state["param_groups"], self._extra_names()):
            group["params"] = [*group["params"], *names]
        state["state"].update((name, live[param]) for name, param in self.extras.items() if param in live)
        return self._with_values(state)

    def _extra_names(self) -> list[list[str]]:
        """The extras' names in each live parameter group, in the group's order."""
        named = {id(param): name for name, param in self.extras.items()}
        return [[named[id(p)] for p in group["params"] if id(p) in named] for group in self.optimizer.param_groups]

    def state_dict_to_load(self) -> dict[str, Any]:
        """The structure a checkpoint is loaded into: every parameter's state, created if it does not exist yet.

        A fresh optimizer gets placeholder state from DCP's zero-learning-rate step (gradients that
        exist are set aside meanwhile, since DCP skips the step when it sees any); `load_state_dict`
        then replaces all of it with the checkpoint's, so no counter is advanced.
        """
        if not self.optimizer.state:
            params = [param for group in self.optimizer.param_groups for param in group["params"]]
            grads = [param.grad for param in params]
            for param in params:
                param.grad = None
            try:
                _init_optim_state(self.optimizer)
            finally:
                for param, grad in zip(params, grads):
                    param.grad = grad
        return self._named_state()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the optimizer's state and hyperparameters with `state_dict` (keyed by parameter name)."""
        state = dict(state_dict)
        state.setdefault("state", {})  # DCP stores no empty mappings: a never-stepped optimizer comes back without it
        state = self._own_groups(state)
        if not self.extras:
            set_optimizer_state_dict(self.model, self.optimizer, _containers_copy(state))
            return
        extras = set(self.extras)
        values = state.pop("parameters", None) or {}
        missing = sorted(extras - set(values))
        if missing:
            raise ValueError(f"the optimizer state to load has no values for {missing}; it was saved without them")
        with torch.no_grad():
            for name, param in self.extras.items():
                if values[name] is not param.data:  # DCP read them in place already
                    param.copy_(values[name])
        outside = {name: state["state"][name] for name in extras if name in state["state"]}
        inside = {
            "state": {name: value for name, value in state["state"].items() if name not in extras},
            "param_groups": [
                {**group, "params": [name for name in group["params"] if name not in extras]}
                for group in state["param_groups"]
            ],
        }
        view = self._model_view()
        set_optimizer_state_dict(self.model, view, _containers_copy(inside))
        # `load_state_dict` replaced the view's state and groups: carry them back to the optimizer.
        live = self.optimizer.state
        live.clear()
        live.update(view.state)
        for group, loaded in zip(self.optimizer.param_groups, view.param_groups):
            group.update((key, value) for key, value in loaded.items() if key != "params")
        for name, value in outside.items():
            param = self.extras[name]
            live[param] = {key: _like(tensor, param, key) for key, tensor in value.items()}

    def _own_groups(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with each group listing this optimizer's own parameters, when the checkpoint's list others.

        DCP keeps one copy of the parameter groups (they are not tensors): the saving
        coordinator's. Ranks that own other parameters (pipeline stages) read the hyperparameters
        from it and their own names from the live optimizer; per-parameter state is keyed by name,
        so each rank keeps exactly the entries of its parameters.
        """
        groups, live = state.get("param_groups"), self._group_names()
        if not isinstance(groups, list) or len(groups) != len(live):
            return state
        if all(list(group.get("params", [])) == names for group, names in zip(groups, live)):
            return state
        owned = {name for names in live for name in names}
        groups = [{**group, "params": names} for group, names in zip(groups, live)]
        return {**state, "param_groups": groups, "state": {k: v for k, v in state["state"].items() if k in owned}}


class TrainingState:
    """Model and (optionally) optimizer under one checkpoint key: ``{"model": ..., "optimizer": ...}``.

    Args:
        model: The model (see [`ModelState`][danling.checkpoint.training.ModelState]).
        optimizer: Its optimizer, or `None` for weights only.
        strict: Whether loading requires the model keys to match exactly.

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1)).state_dict()
        >>> sorted(state), sorted(state["model"])
        (['model', 'optimizer'], ['bias', 'weight'])
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True):
        self.model = ModelState(model, strict=strict)
        self.optimizer = None if optimizer is None else OptimizerState(model, optimizer)

    def __repr__(self) -> str:
        return f"TrainingState({self.model!r}, {self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ...}`` plus ``"optimizer"`` when an optimizer is bound."""
        if self.optimizer is None:
            return {"model": self.model.state_dict()}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def state_dict_to_load(self) -> dict[str, Any]:
        """Like `state_dict`, with the optimizer's state created if it does not exist yet."""
        if self.optimizer is None:
            return {"model": self.model.state_dict()}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict_to_load()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict["model"]``, then ``state_dict["optimizer"]`` when both it and an optimizer exist.

        An empty ``"model"`` entry loads the optimizer alone.
        """
        if "model" not in state_dict:
            raise KeyError(f"TrainingState needs a 'model' entry to load, got keys {sorted(state_dict)}")
        if state_dict["model"]:
            self.model.load_state_dict(state_dict["model"])
        if self.optimizer is not None and state_dict.get("optimizer") is not None:
            self.optimizer.load_state_dict(state_dict["optimizer"])


def get_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Model (and optimizer) state keyed by parameter names, ready for any checkpoint backend.

    The plain-mapping form of [`TrainingState`][danling.checkpoint.training.TrainingState]: unlike
    ``optimizer.state_dict()``, the optimizer state is keyed by parameter name, so it survives a
    change of wrapping and a round trip through DCP. An optimizer that has not stepped yet is not
    advanced.

    Returns:
        ``{"model": ...}`` plus ``"optimizer"`` when an optimizer is given.

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> state = get_training_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> sorted(state["model"]), state["optimizer"]["param_groups"][0]["params"]
        (['bias', 'weight'], ['weight', 'bias'])
    """
    return TrainingState(model, optimizer).state_dict()


def set_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load what [`get_training_state`][danling.checkpoint.training.get_training_state] produced into live objects.

    Args:
        model: The (possibly wrapped) model to load ``state["model"]`` into.
        optimizer: The optimizer to load ``state["optimizer"]`` into, or ``None`` to skip it.
        state: A mapping with ``"model"`` and optionally ``"optimizer"``.
        strict: Require the model keys to match exactly.
    """
    TrainingState(model, optimizer, strict=strict).load_state_dict(state)
