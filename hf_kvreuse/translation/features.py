"""Source features of the KV maps: content K/V (RoPE stripped), hidden states, their concatenation, and the ridge
solve of the fit (a leaf module of :mod:`hf_kvreuse.translation`: the mapper, its streamed moments and the
non-linear residual all read it, and it reads none of them).

The maps translate a source model's K/V into a target's (RaReCache-style cross-model reuse; KV Prediction,
Horton et al. 2024, for the hidden-state inputs).
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..devices import input_device
from ..kv import KV, kv_of
from ..local_hooks import local_hooks
from ..rope import RopeShifter


def content_features(kv: KV, shifter: RopeShifter,
                     positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(K~, V)`` as ``[T, H*D]`` float32: keys rotated back to position 0 (RoPE stripped)."""
    out = []
    neg = -positions
    tables = {}  # one cos/sin table per device (a source split over devices)
    for k, v in kv:
        if k.device not in tables:
            tables[k.device] = shifter.cos_sin(neg, k.device)
        kc = shifter.shift(k.float(), None, tables[k.device])
        out.append((kc[0].transpose(0, 1).reshape(k.shape[-2], -1), v[0].float().transpose(0, 1).reshape(v.shape[-2], -1)))
    return out


def flat_features(feats: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[T, L * 2 * H*D]``: layer-major, keys then values (the layout of :class:`MapperStats`)."""
    return torch.cat([t for kv in feats for t in kv], dim=-1)


def gather(blocks: list[tuple[str, int]], feats: list[tuple[torch.Tensor, torch.Tensor]],
           hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Concatenate source feature blocks ``[T, F]``: ``("k", s)`` / ``("v", s)`` from the content K/V ``feats``,
    ``("h", s)`` from the normalised hidden states ``hidden`` (:func:`run_source`)."""
    parts = []
    for kind, s in blocks:
        if kind == "h":
            if hidden is None or s not in hidden:
                raise ValueError(f"this map reads the source's hidden state entering layer {s}; it was not given")
            parts.append(hidden[s].float().to(feats[0][0].device))
        else:
            parts.append(feats[s][0 if kind == "k" else 1])
    return torch.cat(parts, dim=-1)


def ridge_solve(cxx: torch.Tensor, cxy: torch.Tensor, lam: float, scaling: str = "mean") -> torch.Tensor:
    """Ridge weights from centred moments. ``scaling="mean"``: ``(C + lam * mean(diag C) I)^-1 C_xy`` (the shipped
    map; one penalty for all inputs); ``"std"``: the same on standardised inputs (each feature penalised relative
    to its own variance: inputs of very different scales, e.g. K/V beside normalised hidden states)."""
    eye = torch.eye(len(cxx), dtype=cxx.dtype)

    def spd_solve(a, b):  # a is symmetric positive definite (ridge): Cholesky, LU if rounding broke that
        chol, info = torch.linalg.cholesky_ex(a)
        return torch.cholesky_solve(b, chol) if int(info) == 0 else torch.linalg.solve(a, b)

    if scaling == "mean":
        return spd_solve(cxx + lam * float(cxx.diagonal().mean().clamp_min(1e-12)) * eye, cxy)
    if scaling != "std":
        raise ValueError(f"scaling={scaling!r}: choose 'mean' or 'std'")
    diag = cxx.diagonal()
    sd = diag.clamp_min(1e-12 * float(diag.max().clamp_min(1e-30))).sqrt()
    return spd_solve(cxx / torch.outer(sd, sd) + lam * eye, cxy / sd[:, None]) / sd[:, None]


def _r2(w: torch.Tensor, cxx: torch.Tensor, cxy: torch.Tensor, vy: torch.Tensor) -> float:
    sst = float(vy.sum().clamp_min(1e-30))
    return 1.0 - (sst - 2 * float((w * cxy).sum()) + float((w * (cxx @ w)).sum())) / sst


@torch.no_grad()
def run_source(model, ids: torch.Tensor, cache, hidden_layers: Iterable[int] = ()) -> dict[int, torch.Tensor]:
    """Forward ``ids`` ``[1, T]`` through ``model`` filling ``cache``; return the normalised residual stream that
    enters each layer of ``hidden_layers`` (the output of its ``input_layernorm``: what its q/k/v projections
    read), ``{s: [T, hidden] float32}``; ``s = num_hidden_layers`` is the final norm's output. Captured with
    forward hooks on the norm modules (Llama-family layout), so the model's own forward is what runs; the hooks
    write only into the sink of the context that registered them (a forward of the same model in another thread
    while they exist captures nothing and is not changed)."""
    from ..compat import cache_kwargs

    base = model.model
    n_layers = len(base.layers)
    grabbed: dict[int, torch.Tensor] = {}
    with local_hooks() as hooks:  # this call only: another thread's forward captures nothing and is unchanged
        for s in sorted(set(hidden_layers)):
            if not 0 <= s <= n_layers:
                raise ValueError(f"hidden layer {s} outside 0..{n_layers} of {type(model).__name__}")
            mod = base.norm if s == n_layers else base.layers[s].input_layernorm
            hooks.forward(mod, lambda m, a, out, s=s: grabbed.__setitem__(s, out[0].float()))
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return grabbed


@torch.no_grad()
def _run_features(model, ids: torch.Tensor, shifter: RopeShifter, hidden_layers=None):
    """Content K/V per layer (CPU float32); with ``hidden_layers`` (possibly empty) also the normalised hidden
    states ``{s: [T, hidden]}`` of :func:`run_source`: ``(feats, hidden)``."""
    from transformers import DynamicCache

    device = input_device(model)
    ids = ids.to(device)
    cache = DynamicCache(config=model.config)
    hidden = run_source(model, ids, cache, hidden_layers or ())
    feats = content_features(kv_of(cache), shifter, torch.arange(ids.shape[1], device=device))
    feats = [(k.cpu(), v.cpu()) for k, v in feats]
    if hidden_layers is None:
        return feats
    return feats, {s: h.cpu() for s, h in hidden.items()}
