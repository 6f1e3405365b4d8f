"""KVMapper: closed-form linear maps from a small source model's KV cache to a larger target model's.

Heo et al., "Cross-Model KV Cache Transfer in LLM Families: A Closed-Form Linear Mapping for Prefill Reuse"
(arXiv 2608.03893; METHODS.md §2.4.a), as used by RaReCache (seed 004):

1. run both models on calibration text and take every layer's K (RoPE stripped: content space,
   ``k~ = R(p)^-1 k``) and V, per position (every ``stride``-th);
2. for each target layer, rank the source layers by single-source R² (ridge, pooled K+V features) and keep the
   ``top_k`` best;
3. ridge regression on centred data, separately for K and V, from the concatenated features of those source
   layers (all heads) to the target layer (each head is an independent set of output columns):
   ``W = (C_xx + lambda * s * I)^-1 C_xy``, ``b = mean_y - mean_x W``;
4. online: ``K_t = RoPE_target(strip(K_s) W_K + b_K)``, ``V_t = V_s W_V + b_V``.

Everything is accumulated in a streaming pass (:class:`MapperStats`: sums and cross-products in float64), so
the calibration size does not bound memory; the fit itself is a handful of small solves. ``lambda`` is relative
(``s`` is the mean feature variance of the regression's inputs), which makes it independent of the models' K/V
scale: Heo et al. report a flat region around 0.01 that collapses near 1, which only a scale-free penalty shows.

The same pass also records, per target (layer, head, kind), the covariance of the *mapped* calibration outputs
``C_yhat = W^T C_xx W`` and the right singular vectors of ``W``: the output directions the calibration data
supports strongly or weakly, read by :class:`~hf_kvreuse.translation.scorers.RankDisagreementScorer`.

Choices beyond the sources (documented, measured in the research notes): the first ``skip_first`` positions of each
calibration sequence are left out (attention-sink tokens have outlier K/V and are always recomputed online),
and the pair's identity is checked on load (configs and a weight fingerprint: the same architecture with other
weights is another pair).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from ..kv import KV
from ..rope import RopeShifter
from .features import _r2, _run_features, content_features, flat_features, gather, ridge_solve, run_source  # noqa: F401
from .moments import depth_band
from .residual import apply_residual
from ..errors import HFKVReuseError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)   # 1: K->K / V->V maps only (no inputs_* / residual tensors)
_KIND_CODE = {"k": 0, "v": 1, "h": 2}
KINDS = ("k", "v", "h")


class MapperMismatchError(HFKVReuseError, ValueError):
    """A saved KVMapper was fitted for another (source, target) pair."""


@dataclass(frozen=True)
class PairGeometry:
    """K/V geometry of a (source, target) pair as the models' own caches store it."""

    source_layers: int
    source_heads: int
    source_dim: int
    target_layers: int
    target_heads: int
    target_dim: int

    @property
    def fs(self) -> int:  # features of one source layer and kind
        return self.source_heads * self.source_dim

    @property
    def ft(self) -> int:  # features of one target layer and kind
        return self.target_heads * self.target_dim


@dataclass
class MapperConfig:
    """Hyper-parameters of :meth:`KVMapper.fit` (defaults: METHODS.md §2.4.a)."""

    top_k: int = 8               # source layers per target layer (fewer when the source has fewer)
    ridge_lambda: float = 0.01   # relative ridge penalty
    stride: int = 4              # every stride-th calibration position
    skip_first: int = 4          # leading (attention-sink) positions of each sequence left out
    inputs: str = "kv"           # INPUT_KINDS: what each target layer reads (the shipped map: "kv")
    hidden_band: int = 1         # "hidden" kinds: source hidden states within this many layers of matched depth
    scaling: str = "mean"        # ridge penalty: "mean" (one scale) or "std" (per standardised feature)


def model_identity(model) -> dict:
    """What identifies a model for a mapper: its architecture config (no dtype / backend fields) and a
    fingerprint of its weights (a strided sample of every parameter, rounded to bfloat16 so a bf16 and a float32
    load of the same checkpoint agree)."""
    cfg = model.config.to_dict()
    for key in ("dtype", "torch_dtype", "_attn_implementation", "_attn_implementation_autoset", "transformers_version",
                "_name_or_path", "architectures", "use_cache", "output_attentions", "output_hidden_states"):
        cfg.pop(key, None)
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 16)][:16].to(torch.bfloat16).float().cpu()
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return {"model_type": getattr(model.config, "model_type", "?"), "class": type(model).__name__,
            "num_hidden_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
            "weights": h.hexdigest()[:16],
            "config": hashlib.sha1(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]}


def _describe(ident: dict) -> str:
    return (f"{ident.get('class')} ({ident.get('model_type')}, {ident.get('num_hidden_layers')} layers, hidden "
            f"{ident.get('hidden_size')}, weights {ident.get('weights')})")


class MapperStats:
    """Streaming moments of source features ``x`` and target features ``y`` (float64 sums).

    Rows are accumulated around a shift (the first batch's means): K/V features have means large next to their
    smallest variances (Qwen's key biases), and ``E[xx^T] - mean mean^T`` of unshifted float32 products loses
    exactly the small directions the ridge must resolve.
    """

    def __init__(self, geometry: PairGeometry, device: torch.device | str = "cpu"):
        g = self.geometry = geometry
        fx, fy = g.source_layers * 2 * g.fs, g.target_layers * 2 * g.ft
        f64 = dict(dtype=torch.float64, device=device)
        self.n = 0
        self.sx, self.sy = torch.zeros(fx, **f64), torch.zeros(fy, **f64)
        self.xx, self.xy = torch.zeros(fx, fx, **f64), torch.zeros(fx, fy, **f64)
        self.yy = torch.zeros(fy, **f64)  # diagonal only: R² needs the target variance, not its covariance
        self.shift_x: torch.Tensor | None = None
        self.shift_y: torch.Tensor | None = None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows ``x [N, Fx]`` and ``y [N, Fy]`` (float32 products, float64 sums)."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{x.shape[0]} source rows but {y.shape[0]} target rows")
        if x.shape[1] != self.sx.numel() or y.shape[1] != self.sy.numel():
            raise ValueError(f"feature sizes {x.shape[1]}, {y.shape[1]} do not match the pair geometry "
                             f"({self.sx.numel()}, {self.sy.numel()})")
        x, y = x.float(), y.float()
        if self.shift_x is None:
            self.shift_x, self.shift_y = x.mean(0), y.mean(0)
        x, y = x - self.shift_x.to(x.device), y - self.shift_y.to(y.device)
        self.n += x.shape[0]
        self.sx += x.sum(0).double()
        self.sy += y.sum(0).double()
        self.xx += (x.T @ x).double()
        self.xy += (x.T @ y).double()
        self.yy += (y * y).sum(0).double()


@dataclass
class LayerMap:
    """The maps of one target layer: ``K~ = x_K @ w_k + b_k`` and ``V = x_V @ w_v + b_v`` (content space), where
    ``x_K`` / ``x_V`` concatenate the source feature blocks ``inputs_k`` / ``inputs_v`` (``(kind, layer)``,
    kind ``"k"``, ``"v"`` or ``"h"``: :mod:`hf_kvreuse.translation.moments`). The shipped kind reads
    ``("k", s)`` for keys and ``("v", s)`` for values of ``sources``; ``inputs_*`` None means exactly that.
    ``residual`` (optional) adds a low-rank non-linear correction on the union of both inputs:
    ``[K~ | V] += gelu(((x - mu) / sd) @ a + c) @ u``."""

    sources: list[int]                     # the source layers whose K/V blocks it reads
    w_k: torch.Tensor                      # [F_K, Ft]
    b_k: torch.Tensor                      # [Ft]
    w_v: torch.Tensor
    b_v: torch.Tensor
    inputs_k: list | None = None           # [(kind, layer), ...]; None: [("k", s) for s in sources]
    inputs_v: list | None = None
    residual: dict | None = None           # {"mu", "sd": [F_u], "a": [F_u, r], "c": [r], "u": [r, 2 Ft]}
    # per kind ("k", "v"): mapped-output statistics, per target head [H, D(, D)]
    mean: dict = field(default_factory=dict)
    cov_vecs: dict = field(default_factory=dict)   # eigenvectors of W^T C_xx W (columns), descending eigenvalues
    cov_vals: dict = field(default_factory=dict)
    svd_vecs: dict = field(default_factory=dict)   # right singular vectors of W (columns), descending
    svd_vals: dict = field(default_factory=dict)

    def blocks(self, kind: str) -> list[tuple[str, int]]:
        """The feature blocks read for ``kind`` ("k": keys, "v": values)."""
        given = self.inputs_k if kind == "k" else self.inputs_v
        return [tuple(b) for b in given] if given is not None else [(kind, s) for s in self.sources]

    def union_blocks(self) -> list[tuple[str, int]]:
        """The residual's input: the key blocks, then the value blocks not already among them."""
        bk = self.blocks("k")
        return bk + [b for b in self.blocks("v") if b not in bk]


def _layer_map(sources: list[int], parts: dict, g: PairGeometry, inputs_k=None, inputs_v=None) -> LayerMap:
    """A LayerMap from solved ``parts[name] = (w, b, C_xx of its inputs, mean_y)`` (float64), with the mapped-output
    statistics the rank scorer reads: per target head the mean, the eigenbasis of ``W^T C_xx W`` and the right
    singular vectors of ``W``."""
    lm = LayerMap(sources, parts["k"][0].float(), parts["k"][1].float(), parts["v"][0].float(), parts["v"][1].float(),
                  inputs_k=inputs_k, inputs_v=inputs_v)
    heads, d = g.target_heads, g.target_dim
    for name in ("k", "v"):
        w, _, cxx, my = parts[name]
        chat = w.T @ cxx @ w
        cov_vecs, cov_vals, svd_vecs, svd_vals = [], [], [], []
        for h in range(heads):
            vals, vecs = torch.linalg.eigh(chat[h * d:(h + 1) * d, h * d:(h + 1) * d])
            cov_vals.append(vals.flip(0).clamp_min(0))
            cov_vecs.append(vecs.flip(1))
            _, sv, vh = torch.linalg.svd(w[:, h * d:(h + 1) * d], full_matrices=False)
            svd_vals.append(sv)
            svd_vecs.append(vh.T)
        lm.mean[name] = my.reshape(heads, d).float()
        lm.cov_vecs[name], lm.cov_vals[name] = torch.stack(cov_vecs).float(), torch.stack(cov_vals).float()
        lm.svd_vecs[name], lm.svd_vals[name] = torch.stack(svd_vecs).float(), torch.stack(svd_vals).float()
    return lm


INPUT_KINDS = ("kv", "kv-both", "hidden", "kv+hidden")


def input_blocks(inputs: str, sources: list[int], band: list[int]) -> tuple[list, list]:
    """The blocks read by keys and by values for a map kind (:data:`INPUT_KINDS`)."""
    kv = [(kind, s) for s in sources for kind in ("k", "v")]
    h = [("h", s) for s in band]
    if inputs == "kv":
        return [("k", s) for s in sources], [("v", s) for s in sources]
    if inputs == "kv-both":
        return kv, kv
    if inputs == "hidden":
        return h, h
    if inputs == "kv+hidden":
        return kv + h, kv + h
    raise ValueError(f"inputs={inputs!r}: choose one of {INPUT_KINDS}")


class KVMapper:
    """Linear KV maps from a source model's cache to a target model's (see the module docstring).

    Build with :meth:`fit` (or :meth:`from_stats`), keep with :meth:`save` / :meth:`load`.

    Attributes
    ----------
    geometry : PairGeometry
    layers : list of LayerMap, one per target layer
    r2 : Tensor ``[target_layers, source_layers]``
        Single-source R² of each (target, source) layer pair on the calibration data (pooled K+V).
    fit_r2 : Tensor ``[target_layers, 2]``
        In-sample R² of the final K and V maps of each target layer.
    identity : dict
        ``{"source": model_identity(...), "target": ...}`` of the pair it was fitted on.
    info : dict
        Calibration facts (tokens, sequences, fit time, config).
    """

    def __init__(self, geometry: PairGeometry, layers: list[LayerMap], r2: torch.Tensor, fit_r2: torch.Tensor,
                 identity: dict | None = None, info: dict | None = None):
        self.geometry, self.layers, self.r2, self.fit_r2 = geometry, layers, r2, fit_r2
        self.identity = identity or {}
        self.info = info or {}

    # -- fitting ---------------------------------------------------------------------------------------------
    @classmethod
    def from_stats(cls, stats: MapperStats, config: MapperConfig | None = None) -> "KVMapper":
        """Solve the maps from accumulated moments (no models needed: synthetic data works too)."""
        cfg = config or MapperConfig()
        g = stats.geometry
        if stats.n < 2:
            raise ValueError("need at least 2 calibration rows to fit a map")
        n = float(stats.n)
        mx, my = stats.sx / n, stats.sy / n  # means of the shifted rows (small: no cancellation below)
        cxx = stats.xx / n - torch.outer(mx, mx)
        cxy = stats.xy / n - torch.outer(mx, my)
        vy = (stats.yy / n - my * my).clamp_min(0)
        mx, my = mx + stats.shift_x.double().cpu(), my + stats.shift_y.double().cpu()  # the true means
        fs, ft = g.fs, g.ft

        def xcols(s: int, kind: int | None = None) -> torch.Tensor:
            if kind is None:
                return torch.arange(2 * s * fs, 2 * (s + 1) * fs)
            return torch.arange((2 * s + kind) * fs, (2 * s + kind + 1) * fs)

        def ycols(t: int, kind: int | None = None) -> torch.Tensor:
            if kind is None:
                return torch.arange(2 * t * ft, 2 * (t + 1) * ft)
            return torch.arange((2 * t + kind) * ft, (2 * t + kind + 1) * ft)

        def ridge(xi: torch.Tensor, yi: torch.Tensor) -> tuple[torch.Tensor, float]:
            a = cxx[xi][:, xi]
            c = cxy[xi][:, yi]
            scale = float(a.diagonal().mean().clamp_min(1e-12))
            w = torch.linalg.solve(a + cfg.ridge_lambda * scale * torch.eye(len(xi), dtype=a.dtype), c)
            sst = float(vy[yi].sum().clamp_min(1e-30))
            sse = sst - 2 * float((w * c).sum()) + float((w * (a @ w)).sum())
            return w, 1.0 - sse / sst

        k = min(cfg.top_k, g.source_layers)
        r2 = torch.zeros(g.target_layers, g.source_layers)
        for t in range(g.target_layers):
            for s in range(g.source_layers):
                r2[t, s] = ridge(xcols(s), ycols(t))[1]
        layers, fit_r2 = [], torch.zeros(g.target_layers, 2)
        for t in range(g.target_layers):
            sources = sorted(torch.topk(r2[t], k).indices.tolist())
            parts = {}
            for kind, name in ((0, "k"), (1, "v")):
                xi = torch.cat([xcols(s, kind) for s in sources])
                yi = ycols(t, kind)
                w, fit = ridge(xi, yi)
                fit_r2[t, kind] = fit
                b = my[yi] - mx[xi] @ w
                parts[name] = (w, b, cxx[xi][:, xi], my[yi])
            layers.append(_layer_map(sources, parts, g))
        info = {"config": asdict(cfg), "calibration_rows": stats.n}
        return cls(g, layers, r2, fit_r2, info=info)

    @classmethod
    def from_moments(cls, moments, geometry: PairGeometry, config: MapperConfig | None = None,
                     blocks=None) -> "KVMapper":
        """Solve the maps of any input kind from :class:`~hf_kvreuse.translation.moments.BlockMoments`.

        The K/V source layers of each target layer are ranked as in :meth:`from_stats` (single-source R² of the
        pooled K+V, ``top_k`` kept); ``config.inputs`` then says which blocks keys and values read
        (:func:`input_blocks`). ``blocks(t, sources) -> (blocks_k, blocks_v)`` overrides that choice (ablations).
        """
        cfg = config or MapperConfig()
        lay, g = moments.layout, geometry
        if (g.source_layers, g.fs, g.target_layers, g.ft) != (lay.source_layers, lay.kv_width, moments.target_layers,
                                                               moments.ft):
            raise ValueError(f"moments of layout {lay} x {moments.target_layers} target layers do not match {g}")
        if "hidden" in cfg.inputs and blocks is None and (moments.band is None or cfg.hidden_band > moments.band):
            raise ValueError(f"inputs={cfg.inputs!r} with hidden_band={cfg.hidden_band} needs moments accumulated "
                             f"with band >= {cfg.hidden_band} (got {moments.band})")
        ft = moments.ft
        k = min(cfg.top_k, g.source_layers)
        r2 = moments.single_source_r2(cfg.ridge_lambda)
        layers, fit_r2 = [], torch.zeros(g.target_layers, 2)
        for t in range(g.target_layers):
            sources = sorted(torch.topk(r2[t], k).indices.tolist())
            band = depth_band(t, lay.source_layers, moments.target_layers, cfg.hidden_band)
            bk, bv = blocks(t, sources) if blocks is not None else input_blocks(cfg.inputs, sources, band)
            parts = {}
            shared = None  # keys and values reading the same blocks: one factorisation, both outputs
            if bk == bv:
                cxx, cxy, vy, mx, my = moments.cov(bk, t)
                shared = (cxx, cxy, vy, mx, my, ridge_solve(cxx, cxy, cfg.ridge_lambda, cfg.scaling))
            for kind, (name, bl) in enumerate((("k", bk), ("v", bv))):
                sl = slice(kind * ft, (kind + 1) * ft)
                if shared is not None:
                    cxx, cxy, vy, mx, my, w_all = shared
                    w = w_all[:, sl]
                else:
                    cxx, cxy, vy, mx, my = moments.cov(bl, t)
                    w = ridge_solve(cxx, cxy[:, sl], cfg.ridge_lambda, cfg.scaling)
                fit_r2[t, kind] = _r2(w, cxx, cxy[:, sl], vy[sl])
                parts[name] = (w, my[sl] - mx @ w, cxx, my[sl])
            layers.append(_layer_map(sources, parts, g, inputs_k=[tuple(b) for b in bk],
                                     inputs_v=[tuple(b) for b in bv]))
        info = {"config": asdict(cfg), "calibration_rows": moments.n, "source_hidden_size": lay.hidden}
        return cls(g, layers, r2, fit_r2, info=info)

    @classmethod
    def fit(cls, source_model, target_model, calibration_ids: torch.Tensor | Iterable[torch.Tensor],
            top_k: int = 8, ridge_lambda: float = 0.01, stride: int = 4, skip_first: int = 4,
            progress: bool = True, description: str = "", inputs: str = "kv", hidden_band: int = 1,
            scaling: str | None = None) -> "KVMapper":
        """Fit the maps on calibration text.

        Parameters
        ----------
        source_model, target_model : PreTrainedModel
            The pair (same tokenizer). Both are probed by the library's model check: keys must be RoPE keys
            that the library's rotation strips and re-applies exactly.
        calibration_ids : LongTensor ``[B, T]`` or iterable of LongTensor ``[T]`` / ``[1, T]``
            Calibration sequences, run one at a time (memory does not grow with their number).
        top_k, ridge_lambda, stride, skip_first, inputs, hidden_band
            See :class:`MapperConfig`. ``inputs="kv"`` streams :class:`MapperStats` (the shipped map); the other
            kinds stream :class:`~hf_kvreuse.translation.moments.BlockMoments` (the hidden kinds capture the
            source's normalised hidden states with :func:`run_source`).
        scaling : {"mean", "std"}, optional
            Ridge penalty scaling; default "mean" for the K/V kinds, "std" for those that read hidden states.
        progress : bool
            Show a tqdm bar.
        description : str
            What the calibration text is (kept in the saved JSON).
        """
        from ..model_check import require
        from tqdm.auto import tqdm

        if scaling is None:
            scaling = "std" if "hidden" in inputs else "mean"
        cfg = MapperConfig(top_k, ridge_lambda, stride, skip_first, inputs, hidden_band, scaling)
        if stride < 1 or skip_first < 0 or top_k < 1 or ridge_lambda < 0 or hidden_band < 0 or inputs not in INPUT_KINDS:
            raise ValueError(f"invalid mapper config {cfg}")
        src_check = require(source_model, rope=True, who="KVMapper (source model)")
        tgt_check = require(target_model, rope=True, who="KVMapper (target model)")
        g = PairGeometry(source_model.config.num_hidden_layers, src_check.kv_heads, src_check.head_dim,
                         target_model.config.num_hidden_layers, tgt_check.kv_heads, tgt_check.head_dim)
        src_shift = RopeShifter(source_model, layout=src_check.rope_layout)
        tgt_shift = RopeShifter(target_model, layout=tgt_check.rope_layout)
        hidden = "hidden" in inputs
        if inputs == "kv":
            stats = MapperStats(g)
        else:
            from .moments import BlockLayout, BlockMoments, source_rows

            layout = BlockLayout(g.source_layers, g.fs, source_model.config.hidden_size if hidden else 0)
            stats = BlockMoments(layout, g.target_layers, g.ft, band=hidden_band if hidden else None,
                                 cross=inputs == "kv+hidden")
        seqs = list(calibration_ids) if not isinstance(calibration_ids, torch.Tensor) else list(calibration_ids)
        t0 = time.perf_counter()
        tokens = 0
        for ids in tqdm(seqs, desc="KVMapper.fit", disable=not progress, unit="seq"):
            ids = torch.as_tensor(ids).reshape(1, -1)
            if ids.shape[1] <= skip_first:
                continue
            keep = torch.arange(skip_first, ids.shape[1], stride)
            if inputs == "kv":
                x = flat_features(_run_features(source_model, ids, src_shift))[keep]
            else:
                feats, hid = _run_features(source_model, ids, src_shift, range(g.source_layers + 1) if hidden else ())
                x = source_rows(layout, feats, hid if hidden else None)[keep]
            y = flat_features(_run_features(target_model, ids, tgt_shift))[keep]
            stats.add(x, y)
            tokens += ids.shape[1]
        mapper = cls.from_stats(stats, cfg) if inputs == "kv" else cls.from_moments(stats, g, cfg)
        mapper.info["moments_bytes"] = stats.nbytes if inputs != "kv" else (stats.xx.numel() + stats.xy.numel()) * 8
        mapper.identity = {"source": model_identity(source_model), "target": model_identity(target_model)}
        mapper.info.update(calibration_sequences=len(seqs), calibration_tokens=tokens, fit_s=time.perf_counter() - t0,
                           description=description,
                           source_dtype=str(next(source_model.parameters()).dtype).replace("torch.", ""),
                           target_dtype=str(next(target_model.parameters()).dtype).replace("torch.", ""))
        return mapper

    # -- applying ------------------------------------------------------------------------------------------
    @property
    def hidden_layers(self) -> list[int]:
        """Source layers whose normalised hidden state some target layer reads (empty for K/V-only maps)."""
        return sorted({s for lm in self.layers for kind in ("k", "v") for (b, s) in lm.blocks(kind) if b == "h"})

    @property
    def kind(self) -> str:
        return self.info.get("config", {}).get("inputs", "kv")

    def map_layer(self, t: int, feats: list[tuple[torch.Tensor, torch.Tensor]],
                  hidden: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer ``t``'s content-space keys and values ``[T, H_t*D_t]`` (float32) from source features:
        ``feats`` the content K/V per source layer, ``hidden`` the normalised hidden states (maps that read them)."""
        lm = self.layers[t]
        xk = gather(lm.blocks("k"), feats, hidden)
        xv = xk if lm.blocks("v") == lm.blocks("k") else gather(lm.blocks("v"), feats, hidden)
        dev = xk.device
        w = {n: self.on_device(t, n, getattr(lm, n), dev) for n in ("w_k", "b_k", "w_v", "b_v")}
        k, v = torch.addmm(w["b_k"], xk, w["w_k"]), torch.addmm(w["b_v"], xv, w["w_v"])
        if lm.residual is not None:  # hf_kvreuse.translation.residual
            xu = xk if lm.union_blocks() == lm.blocks("k") else gather(lm.union_blocks(), feats, hidden)
            d = apply_residual({n: self.on_device(t, f"residual.{n}", r, dev) for n, r in lm.residual.items()}, xu)
            ft = k.shape[-1]
            k, v = k + d[:, :ft], v + d[:, ft:]
        return k, v

    def on_device(self, t: int, name: str, w: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``w`` (target layer ``t``'s weight ``name``) on ``device``: copied once per device and kept, not on every
        call (a mapper kept on the CPU for a GPU target otherwise moves every weight per prompt). The copy is
        reused only while it is the same tensor unmodified (``_version``); weights that require grad (the output
        fit trains through :meth:`translate_features`) are never cached."""
        if w.device == torch.device(device) or w.requires_grad:
            return w.to(device)
        copies = self.__dict__.setdefault("_device_copies", {})
        key = (t, name, str(device))
        hit = copies.get(key)
        if hit is not None and hit[0] is w and hit[1] == w._version:
            return hit[2]
        copy = w.to(device)
        copies[key] = (w, w._version, copy)
        return copy

    def to_cache_layout(self, flat: torch.Tensor) -> torch.Tensor:
        """``[T, H*D]`` -> ``[1, H, T, D]``."""
        g = self.geometry
        return flat.reshape(flat.shape[0], g.target_heads, g.target_dim).transpose(0, 1)[None]

    def translate(self, source_kv: KV, positions: torch.Tensor, source_shifter: RopeShifter,
                  target_shifter: RopeShifter, dtype: torch.dtype, device: torch.device | None = None,
                  observe=None, hidden: dict[int, torch.Tensor] | None = None, extra_rows: int = 0) -> KV:
        """Target-model K/V (post-RoPE at ``positions``) from a source cache (and, for maps that read them, the
        source's normalised hidden states ``hidden``: ``{layer: [T, hidden]}`` from :func:`run_source`).

        ``observe(t, keys_content, values)`` is called per target layer with the ``[T, H*D]`` float32 maps
        (scorers that read the mapped K/V use it). ``extra_rows``: each layer's storage holds that many more rows
        after the ``T`` mapped ones (zeros; for rows a later forward writes).
        """
        missing = [s for s in self.hidden_layers if hidden is None or s not in hidden]
        if missing:
            raise ValueError(f"this KVMapper ({self.kind}) reads the source's hidden states of layers {missing}; "
                             "pass hidden= (run_source gives them)")
        device = device or source_kv[0][0].device
        feats = [(k.to(device), v.to(device)) for k, v in
                 content_features(source_kv, source_shifter, positions.to(source_kv[0][0].device))]
        return self.translate_features(feats, positions, target_shifter, dtype, device, observe, hidden, extra_rows)

    def translate_features(self, feats: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                           target_shifter: RopeShifter, dtype: torch.dtype, device: torch.device | None = None,
                           observe=None, hidden: dict[int, torch.Tensor] | None = None, extra_rows: int = 0) -> KV:
        """:meth:`translate` from the source's content features (:func:`content_features`) already computed;
        differentiable in the maps (the output fit trains through it) when ``extra_rows == 0``."""
        device = device or feats[0][0].device
        cs = target_shifter.cos_sin(positions.to(device), device)
        out = []
        for t in range(self.geometry.target_layers):
            kc, v = self.map_layer(t, feats, hidden)
            if observe is not None:
                observe(t, kc, v)
            k = target_shifter.shift(self.to_cache_layout(kc), None, cs)
            v = self.to_cache_layout(v)
            if extra_rows:  # one copy into the larger storage (in place of the contiguous copy)
                kk, vv = (k.new_empty(k.shape[:2] + (k.shape[2] + extra_rows, k.shape[3]), dtype=dtype)
                          for _ in range(2))
                kk[..., : k.shape[2], :], vv[..., : v.shape[2], :] = k, v
                kk[..., k.shape[2]:, :], vv[..., v.shape[2]:, :] = 0, 0  # never garbage (NaN times a zero weight)
                out.append((kk, vv))
            else:
                out.append((k.to(dtype).contiguous(), v.to(dtype).contiguous()))
        return out

    # -- identity --------------------------------------------------------------------------------------------
    def check_pair(self, source_model, target_model) -> None:
        """Raise :class:`MapperMismatchError` unless the models are the pair this mapper was fitted on."""
        if not self.identity:
            return
        for role, model in (("source", source_model), ("target", target_model)):
            want, got = self.identity[role], model_identity(model)
            if want == got:
                continue
            what = "architecture/config" if want.get("config") != got.get("config") else "weights"
            raise MapperMismatchError(
                f"this KVMapper was fitted with {role} model {_describe(want)}, but the {role} model given is "
                f"{_describe(got)} (its {what} differ). A map is valid only for the exact pair it was fitted on: "
                "fit one for this pair with KVMapper.fit")
        src_l, tgt_l = source_model.config.num_hidden_layers, target_model.config.num_hidden_layers
        if (src_l, tgt_l) != (self.geometry.source_layers, self.geometry.target_layers):
            raise MapperMismatchError(f"layer counts {src_l}->{tgt_l} do not match the map's geometry {self.geometry}")

    # -- persistence: safetensors + JSON ------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
        """Write ``path/mapper.safetensors`` and ``path/mapper.json`` (no pickles; the JSON records the tensor
        file's sha256, verified by :meth:`load`)."""
        from ..artifacts import write_artifact

        tensors = {"r2": self.r2, "fit_r2": self.fit_r2}
        for t, lm in enumerate(self.layers):
            tensors[f"{t}.sources"] = torch.tensor(lm.sources, dtype=torch.int64)
            for name in ("k", "v"):
                tensors[f"{t}.w_{name}"] = getattr(lm, f"w_{name}").to(dtype)
                tensors[f"{t}.b_{name}"] = getattr(lm, f"b_{name}").float()
                for attr in ("mean", "cov_vecs", "cov_vals", "svd_vecs", "svd_vals"):
                    tensors[f"{t}.{attr}_{name}"] = getattr(lm, attr)[name].float()
                given = lm.inputs_k if name == "k" else lm.inputs_v
                if given is not None:  # [n, 2]: (kind code, layer)
                    tensors[f"{t}.inputs_{name}"] = torch.tensor([[_KIND_CODE[k], s] for k, s in given],
                                                                 dtype=torch.int64).reshape(-1, 2)
            for key, val in (lm.residual or {}).items():
                tensors[f"{t}.residual.{key}"] = val.float()
        meta = {"format": "hf_kvreuse.KVMapper", "version": FORMAT_VERSION, "geometry": asdict(self.geometry),
                "identity": self.identity, "info": self.info}
        return write_artifact(path, "mapper", tensors, meta)

    @classmethod
    def load(cls, path: str | os.PathLike, source_model=None, target_model=None) -> "KVMapper":
        """Read a saved mapper (format 1: the K->K / V->V kind; format 2: any kind; its sha256 and finite values
        verified: :class:`hf_kvreuse.artifacts.CorruptArtifactError` otherwise); with the models given, refuse
        (:class:`MapperMismatchError`) another pair."""
        from ..artifacts import read_artifact, read_meta

        path = Path(path)
        meta = read_meta(path, "mapper", "KVMapper")
        if meta.get("format") != "hf_kvreuse.KVMapper" or meta.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"{path}: not a KVMapper of format version {READABLE_VERSIONS} ({meta.get('format')}, "
                             f"{meta.get('version')})")
        ts, meta = read_artifact(path, "mapper", "KVMapper")
        g = PairGeometry(**meta["geometry"])
        layers = []
        for t in range(g.target_layers):
            lm = LayerMap(ts[f"{t}.sources"].tolist(), ts[f"{t}.w_k"].float(), ts[f"{t}.b_k"], ts[f"{t}.w_v"].float(),
                          ts[f"{t}.b_v"])
            for name in ("k", "v"):
                for attr in ("mean", "cov_vecs", "cov_vals", "svd_vecs", "svd_vals"):
                    getattr(lm, attr)[name] = ts[f"{t}.{attr}_{name}"]
                if f"{t}.inputs_{name}" in ts:
                    setattr(lm, f"inputs_{name}", [(KINDS[c], s) for c, s in ts[f"{t}.inputs_{name}"].tolist()])
            res = {key.split(".", 2)[2]: val for key, val in ts.items() if key.startswith(f"{t}.residual.")}
            lm.residual = res or None
            for name in ("k", "v"):  # the inputs must match the weights' rows
                width = sum(g.fs if kind != "h" else int(meta["info"].get("source_hidden_size", 0)) for kind, _ in lm.blocks(name))
                if width != getattr(lm, f"w_{name}").shape[0]:
                    raise ValueError(f"{path}: target layer {t} {name}: inputs {lm.blocks(name)} are {width} wide, the "
                                     f"weights have {getattr(lm, f'w_{name}').shape[0]} rows")
            layers.append(lm)
        mapper = cls(g, layers, ts["r2"], ts["fit_r2"], meta.get("identity"), meta.get("info"))
        if source_model is not None or target_model is not None:
            if source_model is None or target_model is None:
                raise ValueError("pass both source_model and target_model (or neither) to check the pair")
            mapper.check_pair(source_model, target_model)
        return mapper

    @property
    def nbytes(self) -> int:
        return sum(getattr(lm, a).numel() * 4 for lm in self.layers for a in ("w_k", "w_v")) + sum(
            t.numel() * 4 for lm in self.layers for t in (lm.residual or {}).values())

    def __repr__(self) -> str:
        g = self.geometry
        return (f"KVMapper({g.source_layers}x{g.source_heads}x{g.source_dim} -> {g.target_layers}x{g.target_heads}x"
                f"{g.target_dim}, top_k={len(self.layers[0].sources)}, mean fit R² K "
                f"{float(self.fit_r2[:, 0].mean()):.3f} / V {float(self.fit_r2[:, 1].mean()):.3f})")
