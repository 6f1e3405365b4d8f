"""The Triton per-token K/V deviation kernel (:mod:`hf_kvreuse.triton.deviation`, CacheBlend's selection) against
its torch reference under Triton's interpreter, the top-k selection, and the two callers (BlendCache,
FirstLayerDeviationScorer) on both backends."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import types

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_kvreuse import BlendCache, FirstLayerDeviationScorer, enable, kernels  # noqa: E402
from hf_kvreuse.kv import kv_of  # noqa: E402
from hf_kvreuse.models import tiny_model  # noqa: E402
from hf_kvreuse.models.arch_zoo import rag_prompt  # noqa: E402
from hf_kvreuse.triton import deviation as dv  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RTOL = 1e-5  # float32 sums in another order


def _tol(dtype, upcast):
    # the interpreter truncates the float32 -> bfloat16 rounding of the difference where torch rounds to nearest:
    # up to one bfloat16 ulp per difference, 2 ** -7 relative per squared term
    if dtype == torch.bfloat16 and not upcast:
        return dict(atol=1e-6, rtol=2 ** -6)
    return dict(atol=1e-6, rtol=RTOL)


def _pair(B, H, T, D, dtype, seed=0):
    """``new``: a non-contiguous ``[B, H, T, D]`` view (padded, transposed buffer); ``old``: new plus noise of a
    different size per token, contiguous (so the two have different strides)."""
    g = torch.Generator().manual_seed(seed)
    new = (2 * torch.randn(B, T, H, D + 8, generator=g)).to(dtype).transpose(1, 2)[..., :D]
    scale = torch.rand(T, generator=g)[:, None] + 0.05
    old = (new.float() + scale * torch.randn(B, H, T, D, generator=g)).to(dtype)
    return new, old


@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("B,H,T", [(1, 1, 1), (2, 3, 37), (1, 2, 70)])
def test_matches_reference(upcast, dtype, D, B, H, T):
    """Non-contiguous ``new`` and a contiguous ``old`` of each dtype, batch > 1, odd head counts, token counts and
    head dims, both difference modes, with the squared norm: the kernel equals the reference (float32 sums).

    Planted bug that fails it: the kernel's loop covers the heads of batch row 0 only (``for bh in range(0, H)``)."""
    new, old = _pair(B, H, T, D, dtype)
    got, got_sq = dv.token_deviation_triton(new, old, upcast=upcast, norm=True)
    want, want_sq = dv.token_deviation_torch(new, old, upcast=upcast, norm=True)
    assert got.dtype == torch.float32 and got.shape == (T,)
    torch.testing.assert_close(got, want, **_tol(dtype, upcast))
    torch.testing.assert_close(got_sq, want_sq, atol=1e-6, rtol=RTOL)
    torch.testing.assert_close(dv.token_deviation_triton(new, old, upcast=upcast), got, atol=0, rtol=0)


def test_rounded_versus_upcast_difference():
    """float16 rows where rounding the difference matters (2048 - 0.50049 is 2047.5 exactly, 2048 in float16):
    the default mode squares the rounded difference, ``upcast=True`` the exact one, each equal to its reference
    (float16 rounding is the same in the interpreter and in torch), and the two differ.

    Planted bug that fails it: the launcher never rounds (``ROUND=False``)."""
    new = torch.full((1, 2, 3, 16), 2048.0, dtype=torch.float16)
    old = torch.full((1, 2, 3, 16), 0.50049, dtype=torch.float16)
    rounded = dv.token_deviation_triton(new, old)
    exact = dv.token_deviation_triton(new, old, upcast=True)
    torch.testing.assert_close(rounded, dv.token_deviation_torch(new, old), atol=0, rtol=RTOL)
    torch.testing.assert_close(exact, dv.token_deviation_torch(new, old, upcast=True), atol=0, rtol=RTOL)
    assert (rounded - exact).abs().min() > 1000


def test_norm_is_of_new():
    """``norm=True`` returns ``sum new^2`` per token (not of ``old``, not of the difference), from the same pass.

    Planted bug that fails it: the kernel accumulates ``y * y`` (old) into the norm."""
    new, old = _pair(2, 2, 9, 48, torch.float32, seed=1)
    _, sq = dv.token_deviation_triton(new, old, norm=True)
    torch.testing.assert_close(sq, (new.float() ** 2).sum(dim=(0, 1, 3)), atol=1e-6, rtol=RTOL)
    assert ((sq - (old ** 2).sum(dim=(0, 1, 3))).abs() > 1e-3).any()


def test_deviation_topk_semantics():
    """Candidates exclude the largest rows; picks come in decreasing deviation, as
    ``candidates[topk(dev[candidates], k).indices]`` (the code BlendCache had, bit for bit on the torch path, ties
    included); the triton path picks the same rows when the gaps are clear; ``k=0`` gives none.

    Planted bug that fails it: ``deviation_topk`` takes the top-k of the whole ``dev`` and indexes candidates with
    it (``candidates[torch.topk(dev, k).indices]``)."""
    new, old = _pair(1, 2, 30, 32, torch.float32, seed=2)
    new[:, :, 7] = old[:, :, 7] + 10  # the largest deviation, not a candidate
    new[:, :, 12] = old[:, :, 12] + 3
    new[:, :, 13], old[:, :, 13] = new[:, :, 12], old[:, :, 12]  # an exact tie with row 12
    cand = torch.tensor([c for c in range(30) if c not in (7, 0)])
    d = ((new - old).float() ** 2).sum(dim=(0, 1, 3))
    for k in (1, 2, 5):
        want = cand[torch.topk(d[cand], k).indices]
        got = dv.deviation_topk(new, old, cand, k)
        assert torch.equal(got, want)
        assert 7 not in got.tolist() and set(got[:2].tolist()) <= {12, 13} and got.numel() == k
    gap = d[cand].sort(descending=True).values
    for k in (3, 4):  # clear gaps (relative) below the tied pair
        assert (gap[k - 1] - gap[k]) / gap[k - 1] > 1e-3
        assert set(dv.deviation_topk(new, old, cand, k, use_triton=True).tolist()) == set(
            dv.deviation_topk(new, old, cand, k).tolist())
    assert dv.deviation_topk(new, old, cand, 0).numel() == 0
    assert kernels.deviation_topk(new, old, cand, 2).tolist() == dv.deviation_topk(new, old, cand, 2).tolist()


def test_blend_selects_same_rows_on_triton_backend(monkeypatch):
    """End to end: BlendCache (values and keys deviation) with ``HF_KVREUSE_KERNELS=triton`` runs the deviation
    kernel (counted) and selects the torch backend's rows (their deviations are checked clear of a near-tie at the
    cut), giving the same tokens, close logits and close K/V.

    Planted bugs that fail it: ``kernels.deviation_topk`` never dispatches to triton (``use_triton=False``: no
    launch counted); ``BlendCache.recompute`` compares ``old`` with itself (``kernels.deviation_topk(old, old,
    ...)``: all-zero deviations, a tie at the cut)."""
    model = enable(tiny_model("llama"))
    ids, spans = rag_prompt(3)
    launches, cuts = [], []
    orig_tri, orig_topk = dv.token_deviation_triton, dv.deviation_topk
    monkeypatch.setattr(dv, "token_deviation_triton", lambda *a, **kw: (launches.append(1), orig_tri(*a, **kw))[1])

    def spy_topk(new, old, cand, k, use_triton=False):
        if k and not use_triton:  # the reference run: the k-th and (k+1)-th deviations must not be a near-tie
            d = dv.token_deviation_torch(new, old).to(cand.device)[cand].sort(descending=True).values
            cuts.append(float((d[k - 1] - d[k]) / d[k - 1]) if k < d.numel() else 1.0)
        return orig_topk(new, old, cand, k, use_triton)

    monkeypatch.setattr(dv, "deviation_topk", spy_topk)
    for deviation in ("values", "keys"):
        runs = {}
        for name in ("torch", "triton"):
            monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
            cache = BlendCache(model, ids, spans, recompute_ratio=0.3, deviation=deviation)
            out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                 output_logits=True)
            runs[name] = out, cache.selected_rows.clone(), [(k.clone(), v.clone()) for k, v in kv_of(cache)]
            assert (len(launches) > 0) == (name == "triton")
        launches.clear()
        assert cuts and min(cuts) > 1e-4, cuts
        (ot, st, kvt), (orf, sr, kvr) = runs["triton"], runs["torch"]
        assert sr.numel() > 0 and torch.equal(st, sr)
        assert torch.equal(ot.sequences, orf.sequences)
        torch.testing.assert_close(torch.stack(ot.logits), torch.stack(orf.logits), atol=1e-4, rtol=1e-4)
        for (kt, vt), (kr, vr) in zip(kvt, kvr):
            torch.testing.assert_close(kt, kr, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vt, vr, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("deviation", ["values", "both"])
def test_first_layer_scorer_on_both_backends(monkeypatch, deviation):
    """FirstLayerDeviationScorer on perturbed K/V of a tiny model: the torch backend gives bit for bit the
    scorer's previous formula (``sum (new.float() - old.float())^2 / mean(sum new.float()^2)`` per part) and the
    triton backend the same scores within float32 summation order.

    Planted bug that fails it: the scorer normalises by the deviation instead of the norm
    (``dev += d / d.mean().clamp_min(1e-30)``)."""
    model = enable(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, 33), generator=torch.Generator().manual_seed(9))
    out = model(ids, use_cache=True)
    g = torch.Generator().manual_seed(10)
    base = [(k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g))
            for k, v in kv_of(out.past_key_values)]
    scorer = FirstLayerDeviationScorer(check_layer=1, deviation=deviation)
    scores = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        kv = [(k.clone(), v.clone()) for k, v in base]
        cache = types.SimpleNamespace(model=model, input_ids=ids, exact_layers=0)
        scores[name] = scorer.scores(cache, kv), kv
        assert cache.exact_layers == 2
    s_torch, kv_torch = scores["torch"]
    want = torch.zeros(33)
    for i in {"values": (1,), "both": (0, 1)}[deviation]:
        new = kv_torch[1][i].float()
        d = ((new - base[1][i].float()) ** 2).sum(dim=(0, 1, 3))
        want += d / (new * new).sum(dim=(0, 1, 3)).mean().clamp_min(1e-30)
    assert torch.equal(s_torch, want)
    torch.testing.assert_close(scores["triton"][0], s_torch, atol=1e-6, rtol=RTOL)
