"""Device bookkeeping, in one place: where each decoder layer's K/V live, and per-device copies of index tensors.

A model that accelerate's ``device_map`` splits across devices keeps each decoder layer (and so its K/V) on that
layer's device. Assembly code must therefore take every layer's device from the layer, never from layer 0:
:func:`layer_devices` says where each layer computes, and :class:`PerDevice` hands out one copy of an index tensor
(rows, positions) per device, made once. Offloaded models (accelerate hooks that move weights in and out per
forward) are not thread-safe, so :func:`offloaded` tells background work to refuse them.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model) -> nn.ModuleList | None:
    """The model's list of decoder layers (the ModuleList with ``num_hidden_layers`` entries), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n = getattr(base.config, "num_hidden_layers", None)
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    return None


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device), so it compares equal to the device a tensor reports."""
    if device.index is None and device.type not in ("cpu", "meta"):
        try:
            return torch.empty(0, device=device).device
        except (RuntimeError, AssertionError):  # a device type this torch build cannot allocate on: as given
            return device
    return device


def _module_device(module: nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:  # accelerate: where the module computes, whatever holds its weights between calls
        return _indexed(torch.device(device if not isinstance(device, int) else f"cuda:{device}"))
    for p in module.parameters():
        return p.device
    return None


def input_device(model) -> torch.device:
    """Where the model computes its inputs (token ids go there): the execution device of accelerate's hooks when
    the model is dispatched or offloaded (its parameters may then sit on ``meta``), else the first parameter's."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is not None:
            device = _module_device(module)
            if device is not None and device.type != "meta":
                return device
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer computes on (and so holds its K/V on), in layer order.

    Falls back to the device of the model's first parameter for every layer when the layers cannot be found.
    """
    first = input_device(model)
    layers = decoder_layers(model)
    n = model.config.num_hidden_layers
    if layers is None:
        return [first] * n
    return [_module_device(layer) or first for layer in layers]


def place_kv(kv, devices) -> list:
    """``kv`` (per layer ``(K, V)``) with each layer's tensors on ``devices[i]`` (e.g. :func:`layer_devices`): K/V
    from outside (a store, a file, a caller) go where their layer computes. No copy where already there."""
    return [(k.to(d), v.to(d)) for (k, v), d in zip(kv, devices, strict=True)]


def offloaded(model) -> bool:
    """True when accelerate hooks offload weights (to the CPU or disk) and load them for each forward."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        hooks = getattr(hook, "hooks", [hook]) if hook is not None else []
        if any(getattr(h, "offload", False) for h in hooks):
            return True
    return False


class PerDevice:
    """One copy of a tensor per device, made on first use (e.g. recompute rows used by layers on two devices)."""

    def __init__(self, tensor: torch.Tensor):
        self._copies = {tensor.device: tensor}
        self._first = tensor

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._copies.get(device)
        if t is None:
            t = self._copies[device] = self._first.to(device)
        return t
