"""The Triton row gather / row scatter kernels (:mod:`hf_kvreuse.triton.gather_scatter`) against their torch
references (``index_select`` / ``index_copy_``) under Triton's interpreter, their dispatch, and the caches whose
partial recompute scatters through them."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_kvreuse import enable  # noqa: E402
from hf_kvreuse.kv import kv_of, scatter_kv, slice_kv  # noqa: E402
from hf_kvreuse.models import tiny_model  # noqa: E402
from hf_kvreuse.models.arch_zoo import rag_prompt  # noqa: E402
from hf_kvreuse.triton import gather_scatter as gs  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# a cast on store may differ by one ulp of the destination dtype: the interpreter truncates float32 -> bfloat16
# where torch rounds to nearest (exact copies are compared bit for bit)
ULP = {torch.float32: dict(atol=0, rtol=0), torch.float16: dict(atol=1e-7, rtol=2 ** -10),
       torch.bfloat16: dict(atol=1e-7, rtol=2 ** -7)}


def _padded(B, H, N, D, dtype, seed=0):
    """Non-contiguous ``[B, H, N, D]``: a ``[B, N, H, D + 8]`` buffer seen transposed and sliced, and the buffer
    (its padding columns show any write outside the view)."""
    g = torch.Generator().manual_seed(seed)
    buf = (3 * torch.randn(B, N, H, D + 8, generator=g)).to(dtype)
    return buf.transpose(1, 2)[..., :D], buf


def _rows(N, R, seed=0, unique=False):
    g = torch.Generator().manual_seed(seed + 100)
    if unique:
        return torch.randperm(N, generator=g)[:R]  # unsorted, no repeats
    return torch.randint(0, N, (R,), generator=g)  # unsorted, repeats


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("B,H,N,R", [(1, 1, 1, 1), (2, 3, 37, 11), (1, 2, 70, 70)])
def test_gather_matches_index_select(dtype, D, B, H, N, R):
    """Non-contiguous ``src`` of each dtype, unsorted rows with repeats, non-power-of-two lengths: the kernel's
    gather equals ``index_select(-2, rows)`` bit for bit (a copy), also into a non-contiguous ``out=``.

    Planted bug that fails it: the gather reads row ``r`` instead of ``rows[r]`` (``src_t = r`` in the kernel's
    gather branch)."""
    src, _ = _padded(B, H, N, D, dtype)
    assert N == 1 or not src.is_contiguous()
    rows = _rows(N, R)
    want = gs.gather_rows_torch(src, rows)
    assert torch.equal(gs.gather_rows_triton(src, rows), want)
    out = torch.full((H, B, R, D), float("nan"), dtype=dtype).transpose(0, 1)  # [B, H, R, D], H outermost
    assert gs.gather_rows_triton(src, rows, out=out) is out
    assert torch.equal(out, want)
    out_ref = torch.empty(B, H, R, D, dtype=dtype)
    assert gs.gather_rows_torch(src, rows, out=out_ref) is out_ref and torch.equal(out_ref, want)


@pytest.mark.parametrize("dst_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,N,R", [(80, 37, 9), (128, 5, 5), (64, 50, 1)])
def test_scatter_matches_index_copy(dst_dtype, src_dtype, D, N, R):
    """Scatter into a non-contiguous cache view (padded, transposed buffer) from non-contiguous rows of each
    dtype: equals ``index_copy_(-2, rows, src.to(dst.dtype))`` (bit for bit without a cast, within one ulp of the
    destination with one), rows not written stay bit-identical and the buffer's padding columns are never touched.

    Planted bug that fails it: the kernel drops the head-dim mask (``m = ok[:, None] & (d < BLOCK_DA)[None, :]``):
    a non-power-of-two head dim then writes into the padding (and the next head)."""
    dst, buf = _padded(2, 3, N, D, dst_dtype, seed=1)
    src, _ = _padded(2, 3, R, D, src_dtype, seed=2)
    rows = _rows(N, R, seed=3, unique=True)
    before = buf.clone()
    want = dst.clone()
    gs.scatter_rows_torch(want, rows, src)
    gs.scatter_rows_triton(dst, rows, src)
    if src_dtype == dst_dtype or src_dtype in (torch.bfloat16, torch.float16) and dst_dtype == torch.float32:
        assert torch.equal(dst, want)  # exact copy (or an exact widening)
    else:
        torch.testing.assert_close(dst, want, **ULP[dst_dtype])
    assert torch.equal(buf[..., D:], before[..., D:])  # padding untouched
    keep = torch.ones(N, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(dst[:, :, keep], before.transpose(1, 2)[..., :D][:, :, keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_pair_one_launch(dtype, monkeypatch):
    """K and V of different head dims (64 / 80), dtypes and strides in one launch: gather and scatter equal the
    references for both, and each is a single kernel launch.

    Planted bug that fails it: V's rows are addressed with K's strides (``*a_src.stride(), *a_dst.stride()``
    passed twice in ``_launch``)."""
    k, _ = _padded(2, 3, 41, 64, dtype, seed=4)
    v = (torch.randn(3, 2, 80, 41, dtype=torch.float32)).to(torch.float16).permute(1, 0, 3, 2)  # [B, H, N, D]
    rows = _rows(41, 13, seed=5)
    triton_mod, kernel = gs._kernel()
    launches = []

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gs, "_kernel", lambda: (triton_mod, Spy()))
    gk, gv = gs.gather_kv_rows_triton(k, v, rows)
    wk, wv = gs.gather_kv_rows_torch(k, v, rows)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert len(launches) == 1
    urows = _rows(41, 13, seed=6, unique=True)
    sk = torch.randn(2, 3, 13, 64).transpose(-1, -2).contiguous().transpose(-1, -2).to(dtype)
    sv = torch.randn(2, 3, 13, 80, dtype=torch.float16)
    dk, dv, ek, ev = k.clone(), v.clone(), k.clone(), v.clone()
    gs.scatter_kv_rows_triton(dk, dv, urows, sk, sv)
    gs.scatter_kv_rows_torch(ek, ev, urows, sk, sv)
    assert torch.equal(dk, ek) and torch.equal(dv, ev)
    assert len(launches) == 2


def test_row_checks():
    """Rows out of ``[0, N)`` raise ``IndexError`` (as ``index_select`` / ``index_copy_`` do); with
    ``check=False`` the kernel still writes nothing outside the tensor (out-of-range rows are masked); no rows is
    a no-op; mismatched shapes raise ``ValueError``.

    Planted bug that fails it: the kernel's row mask forgets the upper bound (``ok = r_ok & (idx >= 0)``): the
    unchecked scatter of row N writes into the buffer past the view."""
    buf = torch.zeros(1, 2, 12, 16)
    dst = buf[:, :, :10]  # N = 10; rows 10, 11 of the buffer lie past the view
    src = torch.ones(1, 2, 2, 16)
    with pytest.raises(IndexError, match="out of range"):
        gs.scatter_rows_triton(dst, torch.tensor([3, 10]), src)
    with pytest.raises(IndexError, match="out of range"):
        gs.gather_rows_triton(dst, torch.tensor([-1]))
    gs.scatter_rows_triton(dst, torch.tensor([3, 10]), src, check=False)
    assert torch.equal(buf[:, :, 3], torch.ones(1, 2, 16)) and buf[:, :, 10:].abs().sum() == 0
    assert buf.sum() == 32
    gs.scatter_rows_triton(dst, torch.tensor([], dtype=torch.long), src[:, :, :0])
    assert gs.gather_rows_triton(dst, torch.tensor([], dtype=torch.long)).shape == (1, 2, 0, 16)
    with pytest.raises(ValueError, match="rows tensor"):
        gs.scatter_rows_triton(dst, torch.tensor([1, 2, 3]), src)


def test_kv_helpers_dispatch(monkeypatch):
    """``kv.slice_kv`` / ``kv.scatter_kv`` with a tensor index: the torch backend is exactly ``index_select`` /
    ``index_copy_`` (bit-identical), the triton backend runs the kernels (counted) with the same result, and a
    slice index still takes the view path.

    Planted bug that fails it: ``kernels.scatter_kv_rows`` calls the torch reference on both backends (no
    launch counted)."""
    g = torch.Generator().manual_seed(7)
    kv = [(torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)) for _ in range(3)]
    rows = torch.tensor([7, 2, 15])
    src = [(torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)) for _ in range(3)]
    calls = []
    for name in ("gather_kv_rows_triton", "scatter_kv_rows_triton"):
        orig = getattr(gs, name)
        monkeypatch.setattr(gs, name, lambda *a, _o=orig, _n=name, **kw: (calls.append(_n), _o(*a, **kw))[1])
    out = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        got = slice_kv(kv, rows)
        dst = [(k.clone(), v.clone()) for k, v in kv]
        scatter_kv(dst, rows, src)
        out[name] = got, dst
        assert len(calls) == (0 if name == "torch" else 2 * len(kv))
    ref_g = [(k.index_select(-2, rows), v.index_select(-2, rows)) for k, v in kv]
    ref_s = [(k.clone().index_copy_(-2, rows, sk), v.clone().index_copy_(-2, rows, sv))
             for (k, v), (sk, sv) in zip(kv, src)]
    for name in ("torch", "triton"):
        got, dst = out[name]
        assert all(torch.equal(a, b) for pa, pb in zip(got, ref_g) for a, b in zip(pa, pb))
        assert all(torch.equal(a, b) for pa, pb in zip(dst, ref_s) for a, b in zip(pa, pb))
    view = slice_kv(kv, slice(2, 5))
    assert view[0][0].data_ptr() == kv[0][0][..., 2:5, :].data_ptr()


@pytest.mark.parametrize("method", ["epic", "optimistic", "blend"])
def test_partial_recompute_same_on_triton_backend(monkeypatch, method):
    """End to end: EPICCache and OptimisticCache (partial_forward's scatter cache on every layer) and BlendCache
    (plus its deviation selection) give the torch backend's tokens, close logits and close K/V with
    ``HF_KVREUSE_KERNELS=triton``, and the scatter kernel does run (counted).

    Planted bug that fails it: the triton branch of ``kernels.scatter_kv_rows`` writes the key rows into V as well
    (``gs.scatter_kv_rows_triton(dk, dv, rows, sk, sk, ...)``)."""
    from hf_kvreuse import BlendCache, EPICCache, OptimisticCache, output_cache
    from hf_kvreuse.generation.background import BackgroundPrefill

    from conftest import agent_prompts

    model = enable(tiny_model("llama"))
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)  # swap at a fixed step in both runs
    launches = []
    orig = gs.scatter_kv_rows_triton
    monkeypatch.setattr(gs, "scatter_kv_rows_triton", lambda *a, **kw: (launches.append(1), orig(*a, **kw))[1])
    if method == "optimistic":
        ids_a, ids = agent_prompts(4)
        out_a = model.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)

        def make():
            return OptimisticCache(model, ids, output_cache(out_a), out_a.sequences, max_optimistic_tokens=3,
                                   rebase="commit")
    else:
        ids, spans = rag_prompt(2)

        def make():
            if method == "epic":
                return EPICCache(model, ids, spans)
            return BlendCache(model, ids, spans, recompute_ratio=0.3)
    runs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        cache = make()
        out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
        runs[name] = out, [(k.clone(), v.clone()) for k, v in kv_of(cache)]
        assert (len(launches) > 0) == (name == "triton")
    (ot, kvt), (orf, kvr) = runs["triton"], runs["torch"]
    assert torch.equal(ot.sequences, orf.sequences)
    torch.testing.assert_close(torch.stack(ot.logits), torch.stack(orf.logits), atol=1e-4, rtol=1e-4)
    for (kt, vt), (kr, vr) in zip(kvt, kvr):
        torch.testing.assert_close(kt, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vt, vr, atol=1e-5, rtol=1e-5)
