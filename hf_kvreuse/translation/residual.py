"""Low-rank non-linear residual maps on top of :class:`~hf_kvreuse.translation.mapper.KVMapper`'s linear maps.

Heo et al., "Cross-Model KV Cache Transfer in LLM Families" (arXiv 2608.03893, METHODS.md §2.4.a) report that where
the closed-form linear map fails, a small MLP map recovers up to +37 points. Here the linear map stays, and each
target layer ``t`` gains a correction on the union ``x`` of the source blocks its K and V maps read:

    ``[K~ | V] = linear(x) + gelu(((x - mu) / sd) A + c) U``      (``A``: ``[F, r]``, ``U``: ``[r, 2 Ft]``)

trained with Adam on the calibration rows' residuals ``y - linear(x)`` (each output column scaled by its residual's
standard deviation, so that value and key columns weigh alike). ``U`` starts at zero: before the first step the map
is the linear one. Measured in the research notes (TranslatedCache).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterable

import torch


@dataclass
class ResidualConfig:
    """Hyper-parameters of :func:`train_residual` / :func:`fit_residuals`."""

    rank: int = 64               # width r of the correction
    epochs: int = 10             # passes over the calibration rows
    lr: float = 1e-3
    weight_decay: float = 1e-4
    batch: int = 256
    seed: int = 0


def apply_residual(res: dict, x: torch.Tensor) -> torch.Tensor:
    """The correction ``gelu(((x - mu) / sd) A + c) U`` ``[T, 2 Ft]`` of a residual ``res`` (keys ``mu``, ``sd``,
    ``a``, ``c``, ``u``) on union inputs ``x`` ``[T, F]``."""
    dev = x.device
    r = {n: t.to(dev) for n, t in res.items()}
    return torch.nn.functional.gelu(torch.addmm(r["c"], (x - r["mu"]) / r["sd"], r["a"])) @ r["u"]


def _r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    return 1.0 - float(((pred - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum().clamp_min(1e-30))


def train_residual(x: torch.Tensor, lin: torch.Tensor, y: torch.Tensor,
                   config: ResidualConfig | None = None) -> tuple[dict, dict]:
    """Fit one layer's correction.

    Parameters
    ----------
    x : Tensor ``[N, F]``
        The union of the layer's input blocks on the calibration rows (unstandardised; ``mu`` / ``sd`` come from it).
    lin : Tensor ``[N, 2 Ft]``
        The linear map's content-space ``[K~ | V]`` on those rows.
    y : Tensor ``[N, 2 Ft]``
        The target's true ``[K~ | V]``.

    Returns
    -------
    (residual, stats)
        ``residual``: ``{"mu", "sd", "a", "c", "u"}`` float32 tensors (what :class:`LayerMap.residual` holds);
        ``stats``: in-sample R² of K and V for the linear map and with the correction, rows, seconds.
    """
    cfg = config or ResidualConfig()
    if not (x.shape[0] == lin.shape[0] == y.shape[0]) or lin.shape != y.shape or y.shape[1] % 2:
        raise ValueError(f"train_residual: shapes x {tuple(x.shape)}, lin {tuple(lin.shape)}, y {tuple(y.shape)} "
                         "do not describe N rows of [K | V]")
    if cfg.rank < 1 or cfg.epochs < 0 or cfg.batch < 1 or cfg.lr <= 0:
        raise ValueError(f"invalid residual config {cfg}")
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    x, lin, y = x.float(), lin.float(), y.float()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mu) / sd
    target = y - lin
    scale = target.std(0).clamp_min(1e-6)
    a = torch.nn.Parameter(torch.randn(x.shape[1], cfg.rank, generator=g) / x.shape[1] ** 0.5)
    c = torch.nn.Parameter(torch.zeros(cfg.rank))
    u = torch.nn.Parameter(torch.zeros(cfg.rank, y.shape[1]))
    opt = torch.optim.Adam([a, c, u], lr=cfg.lr, weight_decay=cfg.weight_decay)
    with torch.enable_grad():
        for _ in range(cfg.epochs):
            perm = torch.randperm(x.shape[0], generator=g)
            for j in range(0, len(perm), cfg.batch):
                idx = perm[j:j + cfg.batch]
                d = torch.nn.functional.gelu(xs[idx] @ a + c) @ u
                loss = (((d - target[idx]) / scale) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    res = {"mu": mu, "sd": sd, "a": a.detach().clone(), "c": c.detach().clone(), "u": u.detach().clone()}
    with torch.no_grad():
        full = lin + apply_residual(res, x)
    ft = y.shape[1] // 2
    stats = {"linear_r2": [_r2(lin[:, :ft], y[:, :ft]), _r2(lin[:, ft:], y[:, ft:])],
             "residual_r2": [_r2(full[:, :ft], y[:, :ft]), _r2(full[:, ft:], y[:, ft:])],
             "rows": int(x.shape[0]), "seconds": time.perf_counter() - t0}
    return res, stats


@torch.no_grad()
def fit_residuals(mapper, source_model, target_model, calibration_ids: torch.Tensor | Iterable[torch.Tensor],
                  config: ResidualConfig | None = None, layers: Iterable[int] | None = None, stride: int = 1,
                  skip_first: int = 4, progress: bool = True):
    """Add a trained correction to target layers ``layers`` (default: all) of ``mapper``, in place (only once
    every layer has trained: a failed call leaves the mapper as it was); returns it.

    The pair is checked first (:meth:`KVMapper.check_pair`: a map of another pair is refused). Each calibration
    sequence runs once through both models; its positions ``skip_first::stride`` are the training rows. A layer
    that already has a correction is refitted from its linear map. ``mapper.info["residual"]`` records the
    configuration and the per-layer in-sample R².
    """
    from tqdm.auto import tqdm

    from ..model_check import require
    from ..rope import RopeShifter
    from .features import _run_features, flat_features, gather

    cfg = config or ResidualConfig()
    if mapper.identity:
        mapper.check_pair(source_model, target_model)
    src_check = require(source_model, rope=True, who="fit_residuals (source model)")
    tgt_check = require(target_model, rope=True, who="fit_residuals (target model)")
    src_shift = RopeShifter(source_model, layout=src_check.rope_layout)
    tgt_shift = RopeShifter(target_model, layout=tgt_check.rope_layout)
    hidden_layers = mapper.hidden_layers
    seqs = list(calibration_ids)
    feats_rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    hidden_rows: list[dict[int, torch.Tensor]] = []
    y_rows: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for ids in tqdm(seqs, desc="fit_residuals", disable=not progress, unit="seq"):
        ids = torch.as_tensor(ids).reshape(1, -1)
        if ids.shape[1] <= skip_first:
            continue
        keep = torch.arange(skip_first, ids.shape[1], stride)
        feats, hid = _run_features(source_model, ids, src_shift, hidden_layers)
        feats_rows.append([(k[keep], v[keep]) for k, v in feats])
        hidden_rows.append({s: h[keep] for s, h in hid.items()})
        y_rows.append(flat_features(_run_features(target_model, ids, tgt_shift))[keep])
    if not y_rows:
        raise ValueError(f"fit_residuals: no calibration sequence is longer than skip_first={skip_first}")
    feats = [(torch.cat([f[s][0] for f in feats_rows]), torch.cat([f[s][1] for f in feats_rows]))
             for s in range(len(feats_rows[0]))]
    hidden = {s: torch.cat([h[s] for h in hidden_rows]) for s in hidden_layers}
    y_all = torch.cat(y_rows)
    ft = mapper.geometry.ft
    per_layer, trained = {}, {}
    todo = range(mapper.geometry.target_layers) if layers is None else list(layers)
    for t in todo:
        lm = mapper.layers[t]
        old, lm.residual = lm.residual, None   # the correction is trained on the linear map's error
        try:
            k, v = mapper.map_layer(t, feats, hidden)
        finally:
            lm.residual = old   # the mapper changes only once every layer has trained
        x = gather(lm.union_blocks(), feats, hidden)
        y = y_all[:, 2 * t * ft:2 * (t + 1) * ft]
        trained[t], per_layer[t] = train_residual(x, torch.cat([k, v], 1), y, cfg)
    for t, res in trained.items():
        mapper.layers[t].residual = res
    mapper.info["residual"] = {"config": asdict(cfg), "calibration_rows": int(y_all.shape[0]),
                               "calibration_sequences": len(y_rows), "fit_s": time.perf_counter() - t0,
                               "layers": {str(t): s for t, s in per_layer.items()}}
    return mapper
