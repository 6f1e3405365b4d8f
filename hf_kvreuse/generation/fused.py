"""Fused first step: the prompt rows a cache still has to compute, computed in the forward that gives the first token.

A cache that computes some prompt rows when it assembles (OptimisticCache's unmatched rows, the rows outside the
reused blocks of a block cache, the rows a method repairs) and then lets ``generate`` run its one-token decode step
pays two passes over the model's weights before the first token. On a small model the second pass is most of a
decode step's cost (Qwen2.5-0.5B, float32, one CPU thread: ~0.2 s against ~0.6 s for 25 rows;
``research/performance/assembly_profile.py``). Here the cache leaves those rows uncomputed and the first forward of ``generate``
runs one :func:`~hf_kvreuse.generation.partial.partial_forward` over them and the last prompt token: the same
position mask (each row sees every column at a position not after its own), so the same K/V and logits up to float
rounding, for one pass over the weights less.

The cache shows ``generate`` the first ``N - 1`` rows (views of full-length storage, the pending rows not yet
written and never read before the forward), so ``generate`` feeds the last prompt token as usual; the cache's
``forward`` hook (:meth:`hf_kvreuse.cache_classes.base.KVReuseCache.forward`) then runs :meth:`PendingRows.run`
instead of the model's one-token forward. :class:`PendingForward` is the general form: a cache that computes its
rows its own way (LatentRemedyCache: latent rows whose input is not a token) gives the whole first forward.
"""

from __future__ import annotations

import torch

from ..compat import set_output_cache
from ..kv import KV, load_kv
from .partial import partial_forward

#: generate outputs that a fused first step would change (they would cover the fused rows, not the last token)
_INTERNALS = ("output_attentions", "output_hidden_states")


def returns_internals(model, generate_kwargs: dict) -> bool:
    """Does this ``generate`` call return attentions or hidden states (then the first forward stays the model's)?"""
    cfg = generate_kwargs.get("generation_config") or model.generation_config
    return any(generate_kwargs.get(k) or getattr(cfg, k, False) for k in _INTERNALS)


class PendingForward:
    """The first forward of ``generate``, run by the cache instead of the model's one-token step.

    Parameters
    ----------
    last_token : int
        The prompt's last token: what ``generate`` must feed to that forward (checked).
    compute : callable, optional
        ``compute(model, cache) -> model output``: writes the cache's K/V (the last prompt token's row included)
        and returns the output whose logits give the first token. Default: the subclass's :meth:`compute`.
    """

    def __init__(self, last_token: int, compute=None):
        self.last_token, self._compute = int(last_token), compute

    def compute(self, model, cache):
        # a method, not a stored bound method: that would be a reference cycle keeping a subclass's K/V storage
        # alive after the first forward until the garbage collector runs
        return self._compute(model, cache)

    @torch.no_grad()
    def run(self, model, cache, fed: torch.Tensor | None):
        """Run ``compute`` and return its output with its cache field set to ``cache``, as the model's one-token
        forward would. ``fed``: the ids ``generate`` fed (must be the last prompt token)."""
        if fed is None or fed.shape[-1] != 1 or int(fed.reshape(-1)[0]) != self.last_token:
            raise RuntimeError(f"{type(cache).__name__}: the first forward fed "
                               f"{None if fed is None else tuple(fed.shape)} instead of the last prompt token; the "
                               "fused first step cannot run (pass fuse_first_step=False)")
        out = self.compute(model, cache)
        set_output_cache(out, cache)
        return out


class PendingRows(PendingForward):
    """Rows of a prompt's K/V left for the first forward of ``generate``.

    Parameters
    ----------
    kv : list of (K, V) ``[1, H, N, D]``
        Full-length storage of the ``N``-token prompt: every row but ``rows`` and the last is written.
    rows : LongTensor ``[R]``
        Increasing row indices still to compute, all before ``N - 1``.
    input_ids : LongTensor ``[1, N]``
        The prompt.
    """

    def __init__(self, kv: KV, rows: torch.Tensor, input_ids: torch.Tensor):
        n = kv[0][0].shape[-2]
        if input_ids.shape[-1] != n:
            raise ValueError(f"pending rows of a {n}-row cache for a prompt of {input_ids.shape[-1]} tokens")
        device = kv[0][0].device
        rows = rows.to(device=device, dtype=torch.long)
        if rows.numel() and int(rows.max()) >= n - 1:
            raise ValueError("the last prompt token's row is the fused forward's own; pending rows come before it")
        self.kv = kv
        self.rows = torch.cat([rows, torch.tensor([n - 1], device=device, dtype=torch.long)])
        self.input_ids = input_ids.to(device)
        super().__init__(int(input_ids[0, -1]))

    def visible(self) -> KV:
        """What the cache holds until the fused forward: views of the first ``N - 1`` rows."""
        n = self.input_ids.shape[-1]
        return [(k[..., : n - 1, :], v[..., : n - 1, :]) for k, v in self.kv]

    def compute(self, model, cache):
        out = partial_forward(model, self.input_ids, self.rows, self.kv)
        load_kv(cache, self.kv)  # the prompt's rows, the last token's included, as a decode step leaves them
        return out
