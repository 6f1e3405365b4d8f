"""Streaming calibration moments over *blocks* of source features, for the richer map kinds of :class:`KVMapper`.

A source row is the concatenation of blocks (layout of :class:`BlockLayout`):

* ``("k", s)``, ``("v", s)`` for ``s < Ls``: the RoPE-stripped keys and the values of source layer ``s``
  (``H_s * D_s`` each; the inputs of the shipped linear map);
* ``("h", s)`` for ``s <= Ls``: the source's normalised residual stream entering layer ``s`` (the output of its
  ``input_layernorm``, ``hidden`` wide: what that layer's q/k/v projections read, which holds the source's K/V
  of that layer as a linear function and 7x more); ``s = Ls`` is the final norm's output.

A target row is, per target layer, its content-space keys then values (``2 * H_t * D_t``).

:class:`BlockMoments` accumulates only what the map kinds read: the Gram of all K/V blocks, the K/V x hidden
cross Gram (``cross=True``), the hidden Gram between layers at most ``2 * band`` apart, ``X^T Y`` of every K/V
block and of each target layer's depth band of hidden blocks (:func:`depth_band`). Rows are shifted by the first
batch's means (K/V features have means large next to their smallest variances); products are float32, sums
``dtype``. Moments add (:meth:`BlockMoments.merge`): a larger calibration set is the sum of smaller ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("k", "v", "h")


def depth_band(t: int, source_layers: int, target_layers: int, width: int) -> list[int]:
    """Source hidden blocks around the depth of target layer ``t``'s input: ``round(t * Ls / Lt) +- width``
    (clamped to ``0..Ls``; ``Ls`` is the final norm's output)."""
    m = round(t * source_layers / target_layers)
    return list(range(max(0, m - width), min(source_layers, m + width) + 1))


@dataclass(frozen=True)
class BlockLayout:
    """Column layout of source rows (see the module docstring)."""

    source_layers: int
    kv_width: int        # H_s * D_s
    hidden: int          # the source's hidden size (0: no hidden blocks)

    @property
    def n_kv(self) -> int:
        return 2 * self.source_layers * self.kv_width

    @property
    def n_features(self) -> int:
        return self.n_kv + ((self.source_layers + 1) * self.hidden if self.hidden else 0)

    def cols(self, block: tuple[str, int]) -> slice:
        kind, s = block
        if kind in ("k", "v"):
            if not 0 <= s < self.source_layers:
                raise ValueError(f"source layer {s} outside 0..{self.source_layers - 1}")
            o = (2 * s + (kind == "v")) * self.kv_width
            return slice(o, o + self.kv_width)
        if kind == "h":
            if not self.hidden or not 0 <= s <= self.source_layers:
                raise ValueError(f"hidden block {s} outside 0..{self.source_layers} (or no hidden blocks)")
            o = self.n_kv + s * self.hidden
            return slice(o, o + self.hidden)
        raise ValueError(f"unknown feature kind {kind!r}: choose one of {KINDS}")

    def width(self, block: tuple[str, int]) -> int:
        return self.hidden if block[0] == "h" else self.kv_width


def source_rows(layout: BlockLayout, feats: list[tuple[torch.Tensor, torch.Tensor]],
                hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``[T, n_features]`` float32 rows from per-layer content K/V ``[T, H*D]`` and normalised hidden ``{s: [T, hidden]}``."""
    parts = [t.float() for kv in feats for t in kv]
    if layout.hidden:
        if hidden is None or set(hidden) != set(range(layout.source_layers + 1)):
            raise ValueError(f"source rows with hidden blocks need the hidden states of layers 0..{layout.source_layers}")
        parts += [hidden[s].float() for s in range(layout.source_layers + 1)]
    return torch.cat(parts, dim=-1)


class BlockMoments:
    """Streaming centred moments of source blocks and target layers (see the module docstring).

    Parameters
    ----------
    layout : BlockLayout
    target_layers, target_width : int
        Target depth and ``H_t * D_t``.
    band : int or None
        Hidden blocks within ``band`` of each target layer's depth are regressed on (None: no hidden moments).
    cross : bool
        Keep the K/V x hidden cross Gram (needed by maps that read both).
    dtype : torch.dtype
        Accumulator dtype (float64 by default; float32 halves the memory).
    """

    def __init__(self, layout: BlockLayout, target_layers: int, target_width: int, band: int | None = 1,
                 cross: bool = True, dtype: torch.dtype = torch.float64):
        if band is not None and not layout.hidden:
            raise ValueError("band given but the layout has no hidden blocks")
        self.layout, self.target_layers, self.ft, self.band, self.cross = layout, target_layers, target_width, band, cross
        L, fy = layout.source_layers, target_layers * 2 * target_width
        z = lambda *s: torch.zeros(*s, dtype=dtype)  # noqa: E731
        self.n = 0
        self.shift_x = self.shift_y = None
        self.sx, self.sy, self.yy = (torch.zeros(layout.n_features, dtype=torch.float64),
                                     torch.zeros(fy, dtype=torch.float64), torch.zeros(fy, dtype=torch.float64))
        self.g_kv = z(layout.n_kv, layout.n_kv)
        self.xy_kv = z(layout.n_kv, fy)
        self.g_kh = z(layout.n_kv, (L + 1) * layout.hidden) if band is not None and cross else None
        self.g_hh, self.xy_h = {}, {}
        if band is not None:
            self.g_hh = {(a, b): z(layout.hidden, layout.hidden) for a in range(L + 1)
                         for b in range(a, min(L, a + 2 * band) + 1)}
            self.xy_h = {t: z(len(self.hband(t)) * layout.hidden, 2 * target_width) for t in range(target_layers)}

    def hband(self, t: int) -> list[int]:
        return depth_band(t, self.layout.source_layers, self.target_layers, self.band or 0)

    @property
    def nbytes(self) -> int:
        ts = [self.g_kv, self.xy_kv, self.g_kh, *self.g_hh.values(), *self.xy_h.values()]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows ``x [N, n_features]`` and ``y [N, target_layers * 2 * target_width]``."""
        lay = self.layout
        if x.shape[0] != y.shape[0] or x.shape[1] != lay.n_features or y.shape[1] != self.sy.numel():
            raise ValueError(f"rows {tuple(x.shape)} / {tuple(y.shape)} do not match the layout "
                             f"({lay.n_features} source, {self.sy.numel()} target features)")
        x, y = x.float(), y.float()
        if self.shift_x is None:
            self.shift_x, self.shift_y = x.mean(0), y.mean(0)
        x, y = x - self.shift_x, y - self.shift_y
        dt = self.g_kv.dtype
        xk, xh = x[:, :lay.n_kv], x[:, lay.n_kv:]
        self.n += x.shape[0]
        self.sx += x.sum(0).double()
        self.sy += y.sum(0).double()
        self.yy += (y * y).sum(0).double()
        self.g_kv += (xk.T @ xk).to(dt)
        self.xy_kv += (xk.T @ y).to(dt)
        if self.g_kh is not None:
            self.g_kh += (xk.T @ xh).to(dt)
        H = lay.hidden
        for (a, b), g in self.g_hh.items():
            g += (xh[:, a * H:(a + 1) * H].T @ xh[:, b * H:(b + 1) * H]).to(dt)
        w = 2 * self.ft
        for t, g in self.xy_h.items():
            band = self.hband(t)
            g += (xh[:, band[0] * H:(band[-1] + 1) * H].T @ y[:, t * w:(t + 1) * w]).to(dt)

    def merge(self, other: "BlockMoments") -> "BlockMoments":
        """Add another accumulation of the same configuration (re-centred onto this one's shift)."""
        if (other.layout, other.target_layers, other.ft, other.band, other.cross) != \
                (self.layout, self.target_layers, self.ft, self.band, self.cross):
            raise ValueError("moments of another configuration")
        if other.n == 0:
            return self
        if self.n == 0:
            for k, v in other.__dict__.items():
                if torch.is_tensor(v):
                    v = v.clone()
                elif isinstance(v, dict):
                    v = {kk: vv.clone() for kk, vv in v.items()}
                setattr(self, k, v)
            return self
        # other rows z = x - s_o; ours are x - s_s = z - d with d = s_s - s_o
        dx = (self.shift_x - other.shift_x).double()
        dy = (self.shift_y - other.shift_y).double()
        n, sx, sy, lay = other.n, other.sx, other.sy, self.layout

        def cross(g, sa, sb, da, db):
            return g.double() - torch.outer(sa, db) - torch.outer(da, sb) + n * torch.outer(da, db)

        kv = slice(0, lay.n_kv)
        self.g_kv += cross(other.g_kv, sx[kv], sx[kv], dx[kv], dx[kv]).to(self.g_kv.dtype)
        self.xy_kv += cross(other.xy_kv, sx[kv], sy, dx[kv], dy).to(self.xy_kv.dtype)
        H, w = lay.hidden, 2 * self.ft
        hs = lambda a, b=None: slice(lay.n_kv + a * H, lay.n_kv + ((b if b is not None else a) + 1) * H)  # noqa: E731
        if self.g_kh is not None:
            h_all = slice(lay.n_kv, lay.n_features)
            self.g_kh += cross(other.g_kh, sx[kv], sx[h_all], dx[kv], dx[h_all]).to(self.g_kh.dtype)
        for (a, b), g in self.g_hh.items():
            g += cross(other.g_hh[(a, b)], sx[hs(a)], sx[hs(b)], dx[hs(a)], dx[hs(b)]).to(g.dtype)
        for t, g in self.xy_h.items():
            band = self.hband(t)
            ih, iy = hs(band[0], band[-1]), slice(t * w, (t + 1) * w)
            g += cross(other.xy_h[t], sx[ih], sy[iy], dx[ih], dy[iy]).to(g.dtype)
        self.yy += other.yy - 2 * sy * dy + n * dy * dy
        self.sx += sx - n * dx
        self.sy += sy - n * dy
        self.n += n
        return self

    # -- centred covariances of any block list ----------------------------------------------------------------
    def _gram(self, a: tuple[str, int], b: tuple[str, int]) -> torch.Tensor:
        lay = self.layout
        ha, hb = a[0] == "h", b[0] == "h"
        ca, cb = lay.cols(a), lay.cols(b)
        if not ha and not hb:
            return self.g_kv[ca, cb]
        if ha and hb:
            if (a[1], b[1]) in self.g_hh:
                return self.g_hh[(a[1], b[1])]
            if (b[1], a[1]) in self.g_hh:
                return self.g_hh[(b[1], a[1])].T
            raise KeyError(f"hidden blocks {a[1]} and {b[1]} were not accumulated together (band {self.band})")
        if self.g_kh is None:
            raise KeyError("K/V x hidden moments were not accumulated (cross=False)")
        if ha:
            return self._gram(b, a).T
        return self.g_kh[ca, cb.start - lay.n_kv:cb.stop - lay.n_kv]

    def _xy(self, a: tuple[str, int], t: int) -> torch.Tensor:
        w = 2 * self.ft
        if a[0] != "h":
            return self.xy_kv[self.layout.cols(a), t * w:(t + 1) * w]
        band = self.hband(t) if self.band is not None else []
        if a[1] not in band:
            raise KeyError(f"hidden block {a[1]} is outside target layer {t}'s depth band {band}")
        H = self.layout.hidden
        i = band.index(a[1])
        return self.xy_h[t][i * H:(i + 1) * H]

    def single_source_r2(self, lam: float) -> torch.Tensor:
        """``[target_layers, source_layers]``: R² of each target layer's pooled K+V from one source layer's
        pooled K+V (ridge ``lam``, one scale): the ranking that picks each target layer's ``top_k`` source layers.
        Memoised per ``lam`` until more rows are added."""
        from .features import _r2, ridge_solve

        key = (lam, self.n)
        memo = self.__dict__.setdefault("_r2_memo", {})
        if key not in memo:
            r2 = torch.zeros(self.target_layers, self.layout.source_layers)
            for t in range(self.target_layers):
                for s in range(self.layout.source_layers):
                    cxx, cxy, vy, _, _ = self.cov([("k", s), ("v", s)], t)
                    r2[t, s] = _r2(ridge_solve(cxx, cxy, lam, "mean"), cxx, cxy, vy)
            memo[key] = r2
        return memo[key]

    def cov(self, blocks: list[tuple[str, int]], t: int):
        """Centred ``C_xx``, ``C_xy`` (target layer ``t``: keys then values), ``var_y``, ``mean_x``, ``mean_y``
        (float64) of the rows' ``blocks``."""
        if self.n < 2:
            raise ValueError("need at least 2 calibration rows")
        n = float(self.n)
        cols = torch.cat([torch.arange(self.layout.n_features)[self.layout.cols(b)] for b in blocks])
        w = 2 * self.ft
        yi = torch.arange(t * w, (t + 1) * w)
        mx, my = self.sx[cols] / n, self.sy[yi] / n
        cxx = torch.cat([torch.cat([self._gram(a, b).double() for b in blocks], 1) for a in blocks], 0) / n
        cxx -= torch.outer(mx, mx)
        cxy = torch.cat([self._xy(a, t).double() for a in blocks], 0) / n - torch.outer(mx, my)
        vy = (self.yy[yi] / n - my * my).clamp_min(0)
        return cxx, cxy, vy, mx + self.shift_x[cols].double(), my + self.shift_y[yi].double()
