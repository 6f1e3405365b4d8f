"""The Triton RoPE rebase kernel against its torch reference (Triton's interpreter on CPU), and the
``HF_KVREUSE_KERNELS`` dispatch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_kvreuse import DirectReuseCache, enable, kernels  # noqa: E402
from hf_kvreuse.kv import kv_of  # noqa: E402
from hf_kvreuse.models import tiny_model  # noqa: E402
from hf_kvreuse.models.arch_zoo import rag_prompt  # noqa: E402
from hf_kvreuse.rope import RopeShifter  # noqa: E402
from hf_kvreuse.triton import rope_rebase as rr  # noqa: E402

from cache_zoo import METHODS as CACHE_METHODS  # noqa: E402

# one ulp or two of each dtype (GPUs may contract the multiply-adds into FMAs; the interpreter is exact
# except for its float32 -> bfloat16 cast, which truncates where torch rounds to nearest)
TOL = {torch.float32: dict(atol=1e-6, rtol=2 ** -22), torch.float16: dict(atol=1e-5, rtol=2 ** -10),
       torch.bfloat16: dict(atol=1e-5, rtol=2 ** -7)}
DTYPES = list(TOL)
LAYOUTS = ["half", "interleaved"]


class _Rotary:
    """A bare rotary module: what RopeShifter reads (``inv_freq``)."""

    def __init__(self, rot):
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


def _shifter(rot, layout):
    return RopeShifter(_Rotary(rot), layout=layout)


def _keys(B, H, T, D, dtype, seed=0):
    """Non-contiguous keys: a padded ``[B, T, H, D + 8]`` buffer seen as ``[B, H, T, D]`` (transposed and sliced)."""
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, T, H, D + 8, generator=g)).to(dtype).transpose(1, 2)[..., :D]


def _deltas(T, seed=0):
    """Per-token deltas: positive, negative and zero in turn (a single token gets a positive one)."""
    g = torch.Generator().manual_seed(seed + 1)
    d = torch.randint(1, 1000, (T,), generator=g)
    d[1::3] = -d[1::3]
    d[2::3] = 0
    return d


def _both(src, delta, sh, dst_like=None):
    want = torch.empty_like(src) if dst_like is None else dst_like()
    got = torch.empty_like(src) if dst_like is None else dst_like()
    rr.rope_rebase_torch(want, src, delta, sh)
    rr.rope_rebase_triton(got, src, delta, sh)
    return got, want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,rot", [(64, 64), (80, 80), (80, 48), (128, 32)])
@pytest.mark.parametrize("T,H", [(1, 3), (7, 1), (33, 2)])
def test_matches_reference(layout, dtype, D, rot, T, H):
    """Non-contiguous keys ``[2, H, T, D]`` of each dtype, full and partial rotary, non-power-of-two lengths and
    head dims, per-token deltas (zero, negative, positive): the kernel equals the torch reference.

    Planted bug that fails it: the kernel pairs dimensions in the other layout (``INTERLEAVED=layout == "half"``
    in :func:`rope_rebase_triton`)."""
    sh = _shifter(rot, layout)
    src = _keys(2, H, T, D, dtype)
    assert not src.is_contiguous()
    delta = _deltas(T)
    got, want = _both(src, delta, sh)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert (want.float() - src.float()).abs().max() > 0.1  # the deltas do turn the keys


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delta_sign_and_zero(layout):
    """A zero delta leaves a token's key bit-identical, ``-d`` undoes ``+d``, and negative deltas match the
    reference (float32, exact up to rounding).

    Planted bug that fails it: the kernel turns the wrong way (``y1 = x1 * c + x2 * s``,
    ``y2 = x2 * c - x1 * s``: the sign of ``sin``, i.e. of the delta, ignored)."""
    sh = _shifter(64, layout)
    src = _keys(1, 2, 9, 64, torch.float32, seed=3)
    delta = torch.tensor([0, -5, 17, 0, -300, 1, -1, 4096, -4096])
    got, want = _both(src, delta, sh)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    zero = delta == 0
    assert torch.equal(got[:, :, zero], src[:, :, zero])
    back = torch.empty_like(got)
    rr.rope_rebase_triton(back, got, -delta, sh)
    torch.testing.assert_close(back, src, atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotary_copies_the_rest(layout):
    """With ``rot < D`` the dimensions from ``rot`` on are copied unchanged (dst starts as NaN, so an unwritten
    element shows) and the leading ones match the reference.

    Planted bug that fails it: the kernel skips the pass-through dimensions (``block_pass = 0``)."""
    sh = _shifter(24, layout)
    src = _keys(2, 2, 7, 80, torch.bfloat16, seed=4)
    got, want = _both(src, _deltas(7), sh, dst_like=lambda: torch.full(src.shape, float("nan"), dtype=src.dtype))
    assert torch.equal(got[..., 24:], src[..., 24:])
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_arbitrary_strides(layout):
    """src with a head-dim stride of 2 (every other element of a wider buffer) and a dst whose strides differ
    from src's (a transposed view of another layout): the kernel equals the reference.

    Planted bug that fails it: the kernel addresses dst with src's strides (``*src.stride(), *src.stride()``)."""
    sh = _shifter(32, layout)
    wide = _keys(2, 3, 5, 2 * 48, torch.float16, seed=5)
    src = wide[..., ::2]  # D = 48, stride 2
    assert src.stride(-1) == 2

    def dst_like():
        return torch.zeros(3, 2, 5, 48, dtype=src.dtype).permute(1, 0, 2, 3)  # [B, H, T, D], H outermost

    got, want = _both(src, _deltas(5), sh, dst_like=dst_like)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dst_aliasing_src(layout, dtype):
    """``dst`` is ``src`` (in place, non-contiguous): the result equals the reference computed out of place.

    Planted bug that fails it: the kernel reloads ``x1`` from src after it has stored ``y1`` (``y2 = x2 * c +
    tl.load(src_row + i1 * s_d) * s``), harmless out of place, wrong in place."""
    sh = _shifter(48, layout)
    src = _keys(1, 2, 11, 64, dtype, seed=6)
    delta = _deltas(11)
    want = torch.empty_like(src)
    rr.rope_rebase_torch(want, src, delta, sh)
    rr.rope_rebase_triton(src, src, delta, sh)
    torch.testing.assert_close(src, want, **TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scalar_and_batched_deltas(layout):
    """A scalar delta (broadcast table) equals the library's :meth:`RopeShifter.shift_into`; a ``[B, T]`` delta
    turns each batch row by its own deltas.

    Planted bug that fails it: the cos/sin table's batch stride is dropped (``c_b = 0``: every row turns by
    row 0's deltas)."""
    sh = _shifter(64, layout)
    src = _keys(2, 2, 6, 64, torch.float32, seed=7)
    want = torch.empty_like(src)
    sh.shift_into(want, src, -37)
    got = torch.empty_like(src)
    rr.rope_rebase_triton(got, src, -37, sh)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    delta = torch.stack([_deltas(6, seed=1), _deltas(6, seed=2)])
    got, want = _both(src, delta, sh)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_generate_with_triton_backend_equals_torch(monkeypatch):
    """End to end: a DirectReuseCache generate (standalone document blocks re-positioned into a prompt, no
    background thread) with ``HF_KVREUSE_KERNELS=triton`` (every key rebase through the kernel) gives the tokens
    and the K/V of the torch backend.

    Planted bug that fails it: ``copy_shifted_`` passes ``-delta`` to ``kernels.rope_rebase`` (or never calls it:
    the spy counts the launches)."""
    model = enable(tiny_model("llama"))
    ids, spans = rag_prompt(1)
    launches = []
    orig_triton = rr.rope_rebase_triton
    monkeypatch.setattr(rr, "rope_rebase_triton", lambda *a: (launches.append(1), orig_triton(*a))[1])
    runs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        cache = DirectReuseCache(model, ids, spans)
        out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
        runs[name] = out, kv_of(cache), cache.stats
        assert (len(launches) > 0) == (name == "triton")
    assert runs["triton"][2].reused_tokens > 0
    assert torch.equal(runs["triton"][0], runs["torch"][0])
    for (kt, vt), (kr, vr) in zip(runs["triton"][1], runs["torch"][1]):
        torch.testing.assert_close(kt, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vt, vr, atol=1e-5, rtol=1e-5)


def test_backend_choice(monkeypatch):
    """``auto`` (and unset) picks torch for CPU tensors; ``torch`` always torch; ``triton`` on CPU needs
    ``TRITON_INTERPRET=1`` and says so; an unknown value raises ``ValueError`` naming the variable.

    Planted bug that fails it: :func:`kernels.mode` returns the value unchecked (no ``ValueError``)."""
    x = torch.zeros(1, 1, 2, 4)
    monkeypatch.delenv("HF_KVREUSE_KERNELS", raising=False)
    assert kernels.backend(x) == "torch" and kernels.backend_name("cpu") == "torch"
    for value, want in [("auto", "torch"), ("torch", "torch"), ("TORCH", "torch"), ("triton", "triton")]:
        monkeypatch.setenv("HF_KVREUSE_KERNELS", value)
        assert kernels.backend(x) == want
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="HF_KVREUSE_KERNELS"):
        kernels.backend(x)
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.backend(x)


def test_package_works_without_triton():
    """With triton hidden (``import triton`` raises), ``hf_kvreuse`` imports, the torch backend rebases keys and
    ``HF_KVREUSE_KERNELS=triton`` raises a clear error, in a fresh process.

    Planted bug that fails it: ``hf_kvreuse/kv.py`` imports ``hf_kvreuse.triton.rope_rebase``'s kernel at
    import time (``from .triton.rope_rebase import _kernel; _kernel()``)."""
    code = r"""
import sys
sys.modules["triton"] = None  # `import triton` raises, importlib.util.find_spec("triton") says None
import os, torch
import hf_kvreuse
from hf_kvreuse import kernels
from hf_kvreuse.kv import copy_shifted_
from hf_kvreuse.rope import RopeShifter
class R: inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
sh = RopeShifter(R(), layout="half")
src = torch.randn(1, 2, 3, 8); dst = torch.empty_like(src)
copy_shifted_(dst, src, sh, 5)
assert torch.allclose(dst, sh.shift(src, 5))
kernels.rope_rebase(dst, src, torch.tensor([1, -2, 0]), sh)
assert kernels.backend(src) == "torch"
os.environ["HF_KVREUSE_KERNELS"] = "triton"
try:
    kernels.backend(src)
except RuntimeError as e:
    assert "triton does not import" in str(e), e
else:
    raise AssertionError("no error")
assert sys.modules.get("triton") is None
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_KVREUSE_KERNELS", "TRITON_INTERPRET")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.fixture(scope="module")
def zoo():
    from cache_zoo import CacheZoo

    return CacheZoo()


@pytest.mark.parametrize("method", CACHE_METHODS)
def test_every_cache_same_tokens_on_triton_backend(monkeypatch, zoo, method):
    """Every cache of the library gives the torch backend's tokens and logits (within float32 rounding) with
    ``HF_KVREUSE_KERNELS=triton`` (the interpreter), and its stats say which backend ran (``kernels``).
    OptimisticCache swaps at step 3 in both runs (``ready`` held False), so its tokens do not depend on when the
    background prefill finishes.

    Planted bug that fails it: ``KVReuseCache.note_kernels`` is skipped (the stats keep ``"torch"``)."""
    from hf_kvreuse.compat import HAS_QUERY_OFFSET
    from hf_kvreuse.generation.background import BackgroundPrefill

    if method == "latent" and not HAS_QUERY_OFFSET:
        pytest.skip("latent tokens need transformers>=5.17")
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    runs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        runs[name] = zoo.run(method)
    assert runs["torch"]["kernels"] == "torch" and runs["triton"]["kernels"] == "triton"
    assert torch.equal(runs["triton"]["tokens"], runs["torch"]["tokens"])
    torch.testing.assert_close(runs["triton"]["logits"], runs["torch"]["logits"], atol=1e-4, rtol=1e-4)
