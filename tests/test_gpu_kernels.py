"""The attention kernels at every head dim and dtype on a GPU (``pytest -m gpu``; skipped without CUDA): the shapes
the compile check (``tests/test_kernel_compile.py``) sizes for sm_80 / sm_90, run on the device against their
torch references. Run by ``scripts/gpu_check.sh``. The CPU tests use head dims <= 128 in Triton's interpreter,
which has no shared-memory or register limits, so only a GPU shows a launch that does not fit."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_selected_attention_every_head_dim(dtype, D):
    """The selected-row kernel at GQA 4 over 300 columns, 100 scattered rows, against the torch reference.

    Planted bug that fails it (not checked: no GPU was lent): fixed 64 x 64 tiles with 3 stages (the code before
    issue 22): float32 at head dim 128 on an A100, 256 on an H100 / H200, raise ``OutOfResources`` (the compile
    check's figures: 181,504 B and 345,344 B of shared memory)."""
    from hf_kvreuse.triton.selected_attention import selected_attention_torch, selected_attention_triton

    g = torch.Generator(device="cuda").manual_seed(D)
    q = torch.randn(1, 8, 100, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, 2, 300, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(1, 2, 300, D, device="cuda", generator=g).to(dtype)
    rows = torch.sort(torch.randperm(300, device="cuda", generator=g)[:100]).values
    pos = torch.arange(300, device="cuda")
    want = selected_attention_torch(q, k, v, rows, pos, D ** -0.5)
    got = selected_attention_triton(q, k, v, rows, pos, D ** -0.5)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("q_len", [1, 96])
def test_lowrank_attention_every_head_dim(dtype, D, q_len):
    """Low-rank value attention, causal prefill (96 queries) and a decode step (split keys), rank 8, against the
    torch reference (float32 reference for the half-precision kernels: it rounds less).

    Planted bug that fails it (not checked: no GPU was lent): the merge of the key splits weighs every split
    equally (no log-sum-exp): the decode step differs."""
    from hf_kvreuse.triton.lowrank_attention import lowrank_attention_torch, lowrank_attention_triton

    g = torch.Generator(device="cuda").manual_seed(D + q_len)
    T, H, Hkv, r = 512, 8, 2, 8
    rnd = lambda *s, scale=1.0: (scale * torch.randn(*s, device="cuda", generator=g)).to(dtype)  # noqa: E731
    query = rnd(1, q_len, H, D).transpose(1, 2)
    key, value = rnd(1, Hkv, T, D), rnd(1, Hkv, T, D)
    L, Bw, s = rnd(1, T, r), rnd(1, Hkv * D, r, scale=0.1), torch.full((1,), 2.0, device="cuda", dtype=dtype)
    args = [t.float() for t in (query, key, value, L, Bw, s)]
    want = lowrank_attention_torch(*args, None, D ** -0.5)
    got = lowrank_attention_triton(query, key, value, L, Bw, s, None, D ** -0.5)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
