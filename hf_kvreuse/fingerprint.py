"""Which weights made a K/V: a fingerprint of every element of every parameter, computed once per version.

K/V rows are exact for another call only if the same weights (and the same active adapters) computed them, so
the session, the chunk store and donor checks key reused K/V by :func:`model_fingerprint`. It must

* cover **every element**: a fine-tune that changes a few rows (or a LoRA update) must change it;
* be **cheap per call**: each parameter's checksum is kept with the parameter's version (torch bumps a tensor's
  ``_version`` on every in-place write, ``load_state_dict`` and optimiser steps included; a new tensor has a new
  storage), so a call re-reads only parameters that changed since, and no device synchronises otherwise;
* be **exact and order-independent**: the checksum works on the raw bits (the elements viewed as int32 words,
  summed in int64 on the parameter's own device by rows and by columns of 1024 words), so thread counts and
  reduction order never change it;
* work on **offloaded** models: a parameter on ``meta`` (accelerate's offload) is read from its hook's weights map.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

_ROW = 1024          # the bits are summed per row of 1024 int32 words and per column of such rows
_CHUNK = 1 << 22     # words per step: row sums < 2^41, column sums < 2^43, both exact in int64
#: id(parameter) -> (weak reference to it, version key, digest); tensors compare elementwise, so no WeakKeyDictionary
_DIGESTS: dict[int, tuple] = {}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as int32 words (zero-padded to whole rows of :data:`_ROW` words)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8)
    pad = (-raw.numel()) % (4 * _ROW)
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32)


def tensor_checksum(t: torch.Tensor) -> bytes:
    """An exact checksum of every element of ``t`` (its bits), computed on ``t``'s device (one transfer).

    Per chunk, the int64 sums of each row and of each column of the words viewed as ``[rows, 1024]``: a changed
    element changes its row's and its column's sum, and two elements swapped differ in row or column. Integer sums
    are exact, so the result does not depend on threads or reduction order.
    """
    words = _words(t)
    parts = []
    for chunk in words.split(_CHUNK):
        m = chunk.view(-1, _ROW)
        parts += [m.sum(1, dtype=torch.int64), m.sum(0, dtype=torch.int64)]
    out = torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.int64)
    return f"{t.dtype}{tuple(t.shape)}".encode() + hashlib.sha1(out.numpy().tobytes()).digest()


def _offloaded_value(module, name: str) -> torch.Tensor | None:
    """The value accelerate keeps for a parameter that lives on ``meta`` between forwards (None if not found)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
        wmap = getattr(h, "weights_map", None)
        if wmap is not None:
            try:
                return wmap[name]
            except KeyError:
                continue
    return None


def _version(p: torch.Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # an inference-mode tensor has no version counter: treated as never written in place
        return -1


def _param_digest(module, name: str, p: torch.Tensor) -> bytes:
    key = (p.data_ptr(), _version(p), tuple(p.shape), p.dtype, p.device)
    hit = _DIGESTS.get(id(p))
    if hit is not None and hit[0]() is p and hit[1] == key:
        return hit[2]
    if p.device.type == "meta":
        value = _offloaded_value(module, name)
        digest = tensor_checksum(value) if value is not None else f"meta{tuple(p.shape)}{p.dtype}".encode()
    else:
        digest = tensor_checksum(p)
    pid = id(p)
    _DIGESTS[pid] = (weakref.ref(p, lambda _, pid=pid: _DIGESTS.pop(pid, None)), key, digest)
    return digest


def model_fingerprint(model) -> str:
    """Identifies the weights (every element) and the active adapters that produce a model's K/V.

    Hashes the config, an exact checksum of every parameter (recomputed only for parameters written since the last
    call) and, for peft-wrapped models, which adapters are active or disabled. 16 hex digits.
    """
    h = hashlib.sha1(model.config.to_json_string(use_diff=False).encode())
    for mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            h.update(f"{mod_name}.{name}".encode())
            h.update(_param_digest(module, name, p))
    h.update(_adapter_state(model).encode())
    return h.hexdigest()[:16]


def _adapter_state(model) -> str:
    """Which peft adapters a tuner layer runs (the first LoRA-style layer speaks for all: peft switches them
    together). transformers' own ``active_adapters`` / ``disable_adapters`` are methods, not state: skipped."""
    for module in model.modules():
        active = getattr(module, "active_adapters", None)
        disabled = getattr(module, "disable_adapters", None)
        if active is not None and disabled is not None and not callable(active) and not callable(disabled):
            return repr((list(active), bool(disabled)))
    return ""


def weights_state(model) -> tuple:
    """A cheap token of the model's *current* weights in this process (no checksum: storage, version, adapters).

    Equal tokens mean nothing was written since; :func:`tag_producer` stamps it on the caches a model returns, so a
    donor that this model made with its present weights is recognised without a probe."""
    target = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    return (tuple((p.data_ptr(), _version(p)) for p in target.parameters()), _adapter_state(target))


_PRODUCER_ATTR = "_hf_kvreuse_producer"


def tag_producer(cache, model) -> None:
    """Record on ``cache`` which model (and weights state) computed its K/V (see :func:`made_by`)."""
    if cache is not None:
        try:
            setattr(cache, _PRODUCER_ATTR, (weakref.ref(model), weights_state(model)))
        except (AttributeError, TypeError):  # a cache type that takes no attributes: it is probed instead
            pass


def made_by(cache, model) -> bool:
    """True when ``cache`` was returned by a ``generate`` of ``model`` with the weights and adapters it has now."""
    tag = getattr(cache, _PRODUCER_ATTR, None)
    return tag is not None and tag[0]() is model and tag[1] == weights_state(model)
