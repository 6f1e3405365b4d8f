"""Which translated positions should the target recompute? One small interface, four scorers.

RaReCache (seed 004; METHODS.md §2.4.b) observes that the mapping errors concentrate on a few information-dense
tokens and picks them *before* the target runs, from the mapped KV alone, with a "rank disagreement" metric:
the energy of a position's mapped KV in output directions weakly supported by the calibration data. The abstract
gives no formula; :class:`RankDisagreementScorer` implements the readings of METHODS.md §2.4.b (off-subspace
energy of the mapped-output covariance, its whitened form, or the small-singular-value directions of ``W``) and
``benchmarks/translated.py`` validates them against the oracle before any is trusted. The baselines:

* :class:`RandomScorer`: uniform scores (seeded);
* :class:`OracleScorer`: the true mapping error, on prompts where the target's own K/V are known (upper bound);
* :class:`FirstLayerDeviationScorer`: CacheBlend-style: the target's first layers run for every token; the
  deviation of their fresh K/V from the mapped ones ranks the tokens (those layers are then exact for all).

A scorer sees each target layer's content-space mapped K/V through :meth:`Scorer.observe` while the cache is
translated, then returns one score per position from :meth:`Scorer.scores` (higher: recompute first).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kv import KV


class Scorer:
    """Base class: ``observe`` per mapped target layer, then ``scores`` once (``[T]``, higher = recompute)."""

    name = "base"

    def reset(self, n_tokens: int, device: torch.device) -> None:
        self.n_tokens = n_tokens

    def observe(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Mapped content-space keys and values ``[T, H*D]`` (float32) of target layer ``layer``."""

    def scores(self, cache, kv: KV) -> torch.Tensor:
        """Scores of the ``T`` covered positions; ``kv`` is the translated target cache (post-RoPE)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RankDisagreementScorer(Scorer):
    """Energy of each position's mapped K/V in the output directions the calibration data supports weakly.

    For every target (layer, head, kind) the mapper stores an orthonormal basis of the mapped outputs
    (descending support) and its spectrum. The weak subspace ``U_w`` is what lies beyond the leading directions
    that hold ``energy`` of the spectrum. Per position ``t`` (``y = yhat_t - mean``):

    * ``variant="energy"`` (default): ``||U_w^T y||² / (||y||² + eps)``, the share of the position's mapped
      vector that falls outside the well-supported subspace;
    * ``variant="whitened"``: ``sum_{i weak} (u_i^T y)² / lambda_i``, the same directions weighted by how rarely
      calibration data reached them.

    ``basis="cov"`` takes the eigenbasis of the mapped-output covariance ``W^T C_xx W``; ``basis="svd"`` the
    right singular vectors of ``W`` (METHODS.md's second reading). Scores are summed over layers, heads and
    kinds (``aggregate="sum"``) or maxed (``"max"``).
    """

    name = "rank"

    def __init__(self, mapper, energy: float = 0.95, variant: str = "energy", basis: str = "cov",
                 kinds: tuple[str, ...] = ("k", "v"), aggregate: str = "sum", eps: float = 1e-6):
        if not 0.0 < energy < 1.0:
            raise ValueError("energy must be in (0, 1)")
        if variant not in ("energy", "whitened"):
            raise ValueError(f"variant={variant!r}: choose 'energy' or 'whitened'")
        if basis not in ("cov", "svd"):
            raise ValueError(f"basis={basis!r}: choose 'cov' or 'svd'")
        if aggregate not in ("sum", "max"):
            raise ValueError(f"aggregate={aggregate!r}: choose 'sum' or 'max'")
        if not set(kinds) <= {"k", "v"} or not kinds:
            raise ValueError("kinds must be a non-empty subset of ('k', 'v')")
        self.mapper, self.energy, self.variant, self.basis = mapper, energy, variant, basis
        self.kinds, self.aggregate, self.eps = tuple(kinds), aggregate, eps
        self._weak = {}  # (layer, kind) -> (mean [H, D], weak basis [H, D, r], weights [H, r])
        for t, lm in enumerate(mapper.layers):
            for kind in ("k", "v"):
                vecs = (lm.cov_vecs if basis == "cov" else lm.svd_vecs)[kind]
                vals = lm.cov_vals[kind] if basis == "cov" else lm.svd_vals[kind] ** 2
                share = vals.cumsum(-1) / vals.sum(-1, keepdim=True).clamp_min(1e-30)
                # strong directions: the fewest leading ones whose energy reaches `energy` (at least one)
                r = int((share < self.energy).sum(-1).max()) + 1
                weak_vals = vals[..., r:]
                w = 1.0 / weak_vals.clamp_min(float(vals.max()) * 1e-6) if variant == "whitened" else torch.ones_like(weak_vals)
                self._weak[(t, kind)] = (lm.mean[kind], vecs[..., r:], w)
        self.name = "rank" if (variant, basis) == ("energy", "cov") else f"rank-{variant}-{basis}"

    def reset(self, n_tokens: int, device: torch.device) -> None:
        super().reset(n_tokens, device)
        self._acc = torch.zeros(n_tokens, device=device)

    def observe(self, layer, keys, values):
        for kind, flat in (("k", keys), ("v", values)):
            if kind not in self.kinds:
                continue
            mean, weak, w = self._weak[(layer, kind)]
            dev = flat.device
            h, d = mean.shape
            y = flat.reshape(flat.shape[0], h, d) - mean.to(dev)               # [T, H, D]
            proj = torch.einsum("thd,hdr->thr", y, weak.to(dev)) ** 2 * w.to(dev)  # [T, H, r]
            s = proj.sum(-1)
            if self.variant == "energy":
                s = s / ((y * y).sum(-1) + self.eps)
            s = s.sum(-1) if self.aggregate == "sum" else s.max(-1).values
            self._acc = self._acc + s if self.aggregate == "sum" else torch.maximum(self._acc, s)

    def scores(self, cache, kv):
        return self._acc

    def __repr__(self) -> str:
        return (f"RankDisagreementScorer(energy={self.energy}, variant={self.variant!r}, basis={self.basis!r}, "
                f"kinds={self.kinds}, aggregate={self.aggregate!r})")


class RandomScorer(Scorer):
    """Uniform random scores (seeded: the same prompt gets the same selection)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def scores(self, cache, kv):
        g = torch.Generator().manual_seed(self.seed)
        return torch.rand(self.n_tokens, generator=g)


class OracleScorer(Scorer):
    """The true mapping error of each position: ``sum_{layers, kinds} ||yhat_t - y_t||² / mean_t ||y_t||²``.

    Parameters
    ----------
    target_kv : Cache or KV
        The target's own K/V of (at least) the covered prompt, e.g. from a full prefill. Only an upper bound for
        evaluation: it costs the very prefill the translation avoids.
    """

    name = "oracle"

    def __init__(self, target_kv):
        from ..kv import kv_of

        self.target_kv = kv_of(target_kv)

    def scores(self, cache, kv):
        n = self.n_tokens
        acc = torch.zeros(n)
        for (k, v), (tk, tv) in zip(kv, self.target_kv):
            for a, b in ((k, tk), (v, tv)):
                b = b[..., :n, :].to(a.device).float()
                err = ((a.float() - b) ** 2).sum(dim=(0, 1, 3))
                acc += (err / (b * b).sum(dim=(0, 1, 3)).mean().clamp_min(1e-30)).cpu()
        return acc

    def __repr__(self) -> str:
        return "OracleScorer(target_kv)"


class FirstLayerDeviationScorer(Scorer):
    """CacheBlend's selection on translated K/V: run the target's layers ``0..check_layer`` for every position
    (those layers become the target's exact K/V for all positions) and score each position by the squared
    deviation of the fresh K/V at ``check_layer`` from the mapped ones (``deviation``: "values", "keys" or
    "both"). Costs ``(check_layer + 1) / L`` of a target prefill.

    ``check_layer=None`` (default): the first layer after the leading layers the cache already runs for every row
    (:class:`~hf_kvreuse.cache_classes.translated.TranslatedCache` ``prefix_layers``), layer 1 when it runs none
    (CacheBlend's choice). An explicit layer before that prefix has no deviation left to measure: the cache
    refuses it at construction (:meth:`layer_for`)."""

    name = "first-layer"

    def __init__(self, check_layer: int | None = None, deviation: str = "values"):
        if deviation not in ("values", "keys", "both"):
            raise ValueError(f"deviation={deviation!r}: choose 'values', 'keys' or 'both'")
        if check_layer is not None and check_layer < 0:
            raise ValueError("check_layer must be >= 0")
        self.check_layer, self.deviation = check_layer, deviation

    def layer_for(self, prefix_layers: int, num_layers: int) -> int:
        """The layer whose deviation is measured after ``prefix_layers`` exact leading layers of a ``num_layers``
        model; raises where an explicit ``check_layer`` lies inside that prefix."""
        if self.check_layer is None:
            return min(max(1, prefix_layers), num_layers - 1)
        c = min(self.check_layer, num_layers - 1)
        if prefix_layers > c:
            raise ValueError(f"FirstLayerDeviationScorer(check_layer={self.check_layer}) measures a layer inside the "
                             f"{prefix_layers} exact leading layers (prefix_layers={prefix_layers}): the deviation "
                             f"from the mapped K/V is gone there; check layer {prefix_layers} or later, or pass "
                             "check_layer=None (the first layer after the prefix)")
        return c

    def scores(self, cache, kv):
        from ..generation.partial import partial_forward

        c = self.layer_for(getattr(cache, "exact_layers", 0), len(kv))
        old = [t.clone() for t in kv[c]]
        n = kv[0][0].shape[-2]
        if hasattr(cache, "run_prefix"):  # TranslatedCache: keeps the rows' hidden states for their recompute
            cache.run_prefix(kv, n, c + 1)
        else:
            rows = torch.arange(n, device=kv[0][0].device)
            partial_forward(cache.model, cache.input_ids[:, :n], rows, kv, layers=range(0, c + 1))
            cache.exact_layers = c + 1
        parts = {"keys": (0,), "values": (1,), "both": (0, 1)}[self.deviation]
        dev = torch.zeros(n, device=kv[0][0].device)
        for i in parts:
            # sum_{b,h,d} of (new - old)^2 and of new^2 per position, in float32 (Triton: one pass, no upcast copies)
            d, sq = kernels.token_deviation(kv[c][i], old[i], upcast=True, norm=True)
            # .to: on a model split over devices, layer c's K/V need not sit beside layer 0's
            dev += (d / sq.mean().clamp_min(1e-30)).to(dev.device)
        return dev

    def __repr__(self) -> str:
        return f"FirstLayerDeviationScorer(check_layer={self.check_layer}, deviation={self.deviation!r})"


def scorer_parts(scorer) -> list:
    """``scorer`` and every scorer it delegates to (a question scorer's ``base``, a combination's parts)."""
    out, todo = [], [scorer]
    while todo:
        s = todo.pop()
        out.append(s)
        todo += [b for b in (getattr(s, "base", None),) if b is not None] + list(getattr(s, "scorers", []) or [])
    return out


class CombinedScorer(Scorer):
    """Several scorers' rank-normalised scores, weighted: ``sum_i w_i rank_i(t) / (T - 1)``.

    Ranks make scorers of unrelated scales commensurable (the first-layer deviation is a squared distance, the
    rank disagreement an energy share). ``"first-layer+rank"``: CacheBlend's deviation with RaReCache's rank
    disagreement, equal weights.
    """

    def __init__(self, scorers: list[Scorer], weights: list[float] | None = None):
        if not scorers:
            raise ValueError("CombinedScorer needs at least one scorer")
        self.scorers = list(scorers)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.scorers)
        if len(self.weights) != len(self.scorers):
            raise ValueError("one weight per scorer")
        self.name = "+".join(s.name for s in self.scorers)

    def reset(self, n_tokens, device):
        super().reset(n_tokens, device)
        for s in self.scorers:
            s.reset(n_tokens, device)

    def observe(self, layer, keys, values):
        for s in self.scorers:
            s.observe(layer, keys, values)

    def scores(self, cache, kv):
        total = torch.zeros(self.n_tokens)
        for w, s in zip(self.weights, self.scorers):
            sc = s.scores(cache, kv).float().cpu()
            total += w * sc.argsort().argsort().float() / max(1, self.n_tokens - 1)
        return total

    def __repr__(self) -> str:
        return f"CombinedScorer({self.scorers}, weights={self.weights})"
