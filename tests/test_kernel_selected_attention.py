"""Position-causal attention of selected rows: the Triton kernel (Triton's interpreter on CPU) and the blocked SDPA
formulation against the torch reference, and the engine wiring (partial_forward and the caches built on it)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_kvreuse import enable, kernels  # noqa: E402
from hf_kvreuse.generation import partial_forward  # noqa: E402
from hf_kvreuse.generation import selected as sel_mod  # noqa: E402
from hf_kvreuse.generation.partial import position_causal_mask  # noqa: E402
from hf_kvreuse.kv import kv_of  # noqa: E402
from hf_kvreuse.models import tiny_model  # noqa: E402
from hf_kvreuse.models.arch_zoo import rag_prompt  # noqa: E402
from hf_kvreuse.triton import selected_attention as sa  # noqa: E402

from conftest import assert_kv_close, exact_prefill  # noqa: E402

# an ulp or two of the output's dtype (outputs are O(1)); float32 also differs by accumulation order
TOL = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _qkv(B, Hq, Hkv, R, N, D, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # [B, T, H, D + 8] buffers seen as [B, H, T, D]: transposed and sliced
        q = torch.randn(B, R, Hq, D + 8, generator=g).to(dtype).transpose(1, 2)[..., :D]
        k = torch.randn(B, N, Hkv, D + 8, generator=g).to(dtype).transpose(1, 2)[..., 4:D + 4]
        v = torch.randn(B, N, Hkv, D + 8, generator=g).to(dtype).transpose(1, 2)[..., :D]
        return q, k, v
    return tuple(torch.randn(B, h, t, D, generator=g).to(dtype) for h, t in ((Hq, R), (Hkv, N), (Hkv, N)))


def _positions(R, N, seed=0, sorted_keys=True):
    g = torch.Generator().manual_seed(seed + 1)
    k_pos = torch.arange(N) if sorted_keys else torch.randperm(N, generator=g)
    q_pos = torch.sort(torch.randperm(N, generator=g)[:R]).values
    return q_pos, k_pos


def _dense(q, k, v, q_pos, k_pos, scaling, k_valid=None):
    """A second oracle: repeat_kv + an additive mask + float64 softmax, as the engine's old mask path computes."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    mask = position_causal_mask(q_pos, k_pos, torch.float64, k_valid)
    w = torch.softmax(q.double() @ kk.transpose(-1, -2) * scaling + mask, dim=-1)
    return w @ vv


def test_reference_equals_dense_mask_attention():
    """The reference equals float64 attention with the engine's additive mask and ``repeat_kv``, with unsorted
    key positions and invalid columns.

    Planted bug that fails it: the reference groups query heads the other way round (``q.view(B, g, Hkv, ...)``:
    query head ``h`` reads KV head ``h % Hkv`` instead of ``h // g``)."""
    q, k, v = _qkv(1, 6, 2, 9, 23, 16, torch.float32)
    q_pos, k_pos = _positions(9, 23, sorted_keys=False)
    valid = torch.arange(23) % 5 != 2
    valid[k_pos.argsort()[0]] = True  # every row keeps at least position 0
    got = sa.selected_attention_torch(q, k, v, q_pos, k_pos, 0.3, valid)
    torch.testing.assert_close(got.double(), _dense(q, k, v, q_pos, k_pos, 0.3, valid), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,Hq,Hkv,R,N,strided", [
    (64, 4, 2, 19, 37, False),   # GQA 2, odd lengths, several row and column tiles
    (80, 3, 3, 5, 21, True),     # head dim 80 (padded to 128), MHA, transposed + sliced views
    (128, 4, 1, 17, 16, False),  # MQA, head dim 128, R > N
])
def test_kernel_matches_reference(dtype, D, Hq, Hkv, R, N, strided):
    """Kernel == reference over odd shapes, GQA / MHA / MQA, head dims 64 / 80 / 128, three dtypes, strided views.

    Planted bug that fails it: the kernel compares ``kp < qp`` (a row does not see its own column)."""
    q, k, v = _qkv(2, Hq, Hkv, R, N, D, dtype, seed=D, strided=strided)
    q_pos = torch.randint(0, N, (R,), generator=torch.Generator().manual_seed(3))
    k_pos = torch.arange(N)
    want = sa.selected_attention_torch(q, k, v, q_pos, k_pos, D ** -0.5)
    got = sa.selected_attention_triton(q, k, v, q_pos, k_pos, D ** -0.5, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_kernel_unsorted_positions_valid_columns_and_out_view():
    """Unsorted key and row positions, a ``k_valid`` mask, an empty row (nothing visible: zeros), a strided
    ``out`` view and a tile bound computed for unsorted keys (the skip must not drop visible columns).

    Planted bug that fails it: :func:`visible_end` assumes sorted keys (``searchsorted(k_pos, qmax)``): visible
    columns after the bound are skipped."""
    N, R, D = 45, 13, 64
    q, k, v = _qkv(1, 4, 2, R, N, D, torch.float32, seed=7)
    g = torch.Generator().manual_seed(5)
    k_pos = torch.randperm(N, generator=g) + 10
    q_pos = torch.randint(10, N + 10, (R,), generator=g)
    q_pos[4] = 3  # before every column: sees nothing
    valid = torch.rand(N, generator=g) > 0.3
    want = sa.selected_attention_torch(q, k, v, q_pos, k_pos, 0.125, valid)
    assert torch.equal(want[:, :, 4], torch.zeros_like(want[:, :, 4]))
    buf = torch.full((1, R, 4, D + 3), 7.0)
    out = buf[..., :D].transpose(1, 2)
    sa.selected_attention_triton(q, k, v, q_pos, k_pos, 0.125, valid, out=out, block_m=16, block_n=16)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    assert torch.equal(buf[..., D:], torch.full_like(buf[..., D:], 7.0))
    # the blocked CPU formulation on the same inputs
    got = sa.selected_attention_blocked(q, k, v, q_pos, k_pos, 0.125, valid, plan=sa.BlockPlan(q_pos, k_pos, valid,
                                                                                              block=4))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_visible_end_bounds_every_visible_column():
    """The per-tile bound covers every column some row of the tile sees, and stops at the tile's own position for
    increasing positions (the skip that halves the work).

    Planted bug that fails it: the bound uses the tile's *first* row position instead of its maximum."""
    q_pos = torch.tensor([30, 2, 9, 40, 41, 7])
    k_pos = torch.arange(50)
    ends = sa.visible_end(q_pos, k_pos, None, 2).tolist()
    assert ends == [31, 41, 42]
    k_pos = torch.tensor([5, 45, 1, 3, 8])  # unsorted: the last index with a position <= the tile's maximum
    assert sa.visible_end(torch.tensor([4, 2]), k_pos, None, 2).tolist() == [4]
    assert sa.visible_end(torch.tensor([0]), k_pos, None, 1).tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [1, 8, 64])
def test_blocked_formulation_equals_mask_path(dtype, block):
    """The blocked SDPA formulation equals what the engine computed before (one SDPA call, boolean mask, repeat_kv)
    for scattered rows plus a contiguous tail (CacheBlend's selection), rows out of order, GQA, three block sizes.

    Planted bug that fails it: :class:`BlockPlan` decides whether a block needs its mask from the block's last
    row only (``mask[-1].all()``), which always sees the whole range: every mask is dropped (future leak)."""
    N, D = 150, 64
    q_pos = torch.cat([torch.sort(torch.randperm(130, generator=torch.Generator().manual_seed(2))[:20]).values,
                       torch.arange(130, N)])
    q_pos = q_pos[torch.randperm(q_pos.numel(), generator=torch.Generator().manual_seed(4))]  # out of order
    k_pos = torch.arange(N)
    q, k, v = _qkv(1, 9, 3, q_pos.numel(), N, D, dtype, seed=11)
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                            attn_mask=mask, scale=0.125)
    got = sa.selected_attention_blocked(q, k, v, q_pos, k_pos, 0.125, plan=sa.BlockPlan(q_pos, k_pos, block=block))
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_dispatch_follows_backend(monkeypatch):
    """``kernels.selected_attention`` runs the kernel under ``triton`` and the blocked formulation under torch.

    Planted bug that fails it: the dispatch ignores the backend (always the blocked formulation)."""
    calls = []
    orig = sa.selected_attention_triton
    monkeypatch.setattr(sa, "selected_attention_triton", lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1])
    q, k, v = _qkv(1, 2, 1, 3, 7, 16, torch.float32)
    pos = sa.SelectedPositions(torch.tensor([6, 1, 3]), torch.arange(7), block_m=16, block_n=16)
    results = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        results[name] = kernels.selected_attention(q, k, v, pos, 0.25)
    assert calls == [1]
    torch.testing.assert_close(results["triton"], results["torch"], **TOL[torch.float32])


# --- the engine -------------------------------------------------------------------------------------------------

def _spy(monkeypatch):
    """Count the calls of the selected-row attention (each layer of a partial forward that takes the path)."""
    calls = []
    orig = kernels.selected_attention
    monkeypatch.setattr(kernels, "selected_attention", lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("kind", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_partial_forward_subset_equals_full_prefill(monkeypatch, kind, arch):
    """A scattered subset of rows recomputed on exact K/V (whole model and a two-range layer split) reproduces full
    prefill's K/V and logits through the selected-row path (the spy sees every layer), and the model's attention
    implementation is restored afterwards.

    Planted bug that fails it: the wrapper ignores the ``scaling`` the layer passes (``scaling = 1.0``)."""
    monkeypatch.setenv("HF_KVREUSE_KERNELS", kind)
    model = tiny_model(arch)
    calls = _spy(monkeypatch)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ref, ref_logits = exact_prefill(model, ids)
    rows = torch.tensor([3, 4, 11, 20, 21, 22, 35, 39])
    n_layers = len(kv_of(ref))
    for layers in (None, "split"):
        kv = [(k.clone(), v.clone()) for k, v in kv_of(ref)]
        for k, v in kv:
            k[..., rows, :] = 0
            v[..., rows, :] = 0
        calls.clear()
        if layers is None:
            out = partial_forward(model, ids, rows, kv, logits_to_keep=0)
            torch.testing.assert_close(out.logits, ref_logits[:, rows], atol=1e-4, rtol=1e-4)
        else:
            h = partial_forward(model, ids, rows, kv, layers=range(0, 2))
            partial_forward(model, ids, rows, kv, layers=range(2, n_layers), hidden_states=h)
        assert len(calls) == n_layers
        assert_kv_close(kv, ref)
        assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kind", ["torch", "triton"])
def test_partial_forward_builds_no_mask_on_the_selected_path(monkeypatch, kind):
    """On the selected-row paths (blocked SDPA on torch, the Triton kernel) ``partial_forward`` never builds the
    ``[R, N]`` position mask (whole model and a layer range; the model gets a zero-memory placeholder), and still
    reproduces full prefill. Layers the wrapper does not handle get the real mask, built once per forward however
    many fall back; the eager model on torch (the mask path) builds it once.

    Planted bug that fails it: ``partial_forward`` builds the mask before choosing the path (the code before
    issue 22: one ``position_causal_mask`` call per forward on every path)."""
    from hf_kvreuse.generation import partial as partial_mod

    monkeypatch.setenv("HF_KVREUSE_KERNELS", kind)
    built = []
    orig = partial_mod.position_causal_mask
    monkeypatch.setattr(partial_mod, "position_causal_mask", lambda *a, **kw: (built.append(a[2]), orig(*a, **kw))[1])
    model = tiny_model("llama")
    n_layers = model.config.num_hidden_layers
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    ref, ref_logits = exact_prefill(model, ids)
    rows = torch.tensor([3, 4, 11, 20, 21, 22, 35, 39])

    def run(layers=False):
        kv = [(k.clone(), v.clone()) for k, v in kv_of(ref)]
        for k, v in kv:
            k[..., rows, :] = 0
            v[..., rows, :] = 0
        if layers:
            h = partial_forward(model, ids, rows, kv, layers=range(0, 1))
            partial_forward(model, ids, rows, kv, layers=range(1, n_layers), hidden_states=h)
        else:
            out = partial_forward(model, ids, rows, kv, logits_to_keep=0)
            torch.testing.assert_close(out.logits, ref_logits[:, rows], atol=1e-4, rtol=1e-4)
        assert_kv_close(kv, ref)

    run()
    run(layers=True)
    assert built == []
    # every layer but the first falls back to the model's own attention: one mask per forward, built on first use
    handles = sel_mod._handles
    monkeypatch.setattr(sel_mod, "_handles", lambda module, *a: module.layer_idx == 0 and handles(module, *a))
    run()
    assert built == [torch.float32]
    built.clear()
    run(layers=True)
    assert built == [torch.bool]  # only the second range (layers 1..) falls back; the sdpa layer path's bool form
    built.clear()
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "torch")
    eager = tiny_model("llama", attn_implementation="eager")
    kv = [(k.clone(), v.clone()) for k, v in kv_of(exact_prefill(eager, ids)[0])]
    partial_forward(eager, ids, rows, kv)
    assert built == [torch.float32]


def test_eager_model_on_torch_keeps_the_mask_path(monkeypatch):
    """An eager model on the torch backend keeps the explicit mask (bit-identical to before: no wrapper call);
    on the triton backend it takes the kernel. Both reproduce full prefill.

    Planted bug that fails it: :func:`selected_path` returns ``"blocked"`` for eager models."""
    model = tiny_model("llama", attn_implementation="eager")
    calls = _spy(monkeypatch)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    ref, _ = exact_prefill(model, ids)
    rows = torch.tensor([2, 9, 10, 19])
    for kind, expect in (("torch", 0), ("triton", len(kv_of(ref)))):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", kind)
        assert sel_mod.selected_path(model, kv_of(ref)[0][0]) == ("mask" if kind == "torch" else "triton")
        kv = [(k.clone(), v.clone()) for k, v in kv_of(ref)]
        calls.clear()
        partial_forward(model, ids, rows, kv)
        assert len(calls) == expect
        assert_kv_close(kv, ref)


def test_wrapper_falls_back_outside_a_partial_forward(monkeypatch):
    """With the wrapper installed but no rows published (another thread's forward during a swap), the model's own
    attention runs: a plain forward gives the same logits; a forward with the wrong query count inside the swap
    falls back too.

    Planted bug that fails it: the wrapper ignores :data:`SELECTED` being None and indexes its positions."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    want = model(ids).logits
    name = sel_mod.register_selected_attention("sdpa")
    model.config._attn_implementation = name
    try:
        torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
        pos = sa.SelectedPositions(torch.arange(3), torch.arange(3))  # 3 rows, but the forward feeds 12
        token = sel_mod.SELECTED.set(pos)
        try:
            torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
        finally:
            sel_mod.SELECTED.reset(token)
    finally:
        model.config._attn_implementation = "sdpa"


def test_model_check_probes_the_path_that_runs(monkeypatch):
    """The model check is cached per engine path: switching ``HF_KVREUSE_KERNELS`` probes again, and a broken
    selected-row attention is refused by the probe (engine and layer-range).

    Planted bug that fails it: ``check_model``'s cache key leaves out the path (the torch result is reused)."""
    from hf_kvreuse.model_check import check_model

    model = tiny_model("llama")
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "torch")
    a = check_model(model)
    assert a.engine_ok and a.extra["attention_path"] == "blocked"
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "triton")
    b = check_model(model)
    assert b is not a and b.engine_ok and b.layers_ok and b.extra["attention_path"] == "triton"
    monkeypatch.setattr(kernels, "selected_attention", lambda q, k, v, p, s, out=None: out.zero_())
    c = check_model(model, refresh=True)
    assert not c.engine_ok and "triton" in c.engine_reason
    assert not c.layers_ok


@pytest.mark.parametrize("method", ["blend", "epic", "optimistic"])
def test_caches_same_on_triton_backend(monkeypatch, method):
    """BlendCache, EPICCache and OptimisticCache generate the same tokens with ``HF_KVREUSE_KERNELS=triton``
    (selected-row kernel + RoPE kernel) as with torch (blocked SDPA), with close K/V; the kernel ran.

    Planted bug that fails it: the kernel drops the last key tile (``range(0, end - BLOCK_N, BLOCK_N)``)."""
    from hf_kvreuse import BlendCache, EPICCache, OptimisticCache, output_cache
    from hf_kvreuse.generation.background import BackgroundPrefill

    from conftest import agent_prompts

    model = enable(tiny_model("llama"))
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    launches = []
    orig = sa.selected_attention_triton
    monkeypatch.setattr(sa, "selected_attention_triton", lambda *a, **kw: (launches.append(1), orig(*a, **kw))[1])
    ids_a, ids_b = agent_prompts(4)
    out_a = model.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    ids, spans = rag_prompt(2)
    make = {
        "optimistic": lambda: (ids_b, OptimisticCache(model, ids_b, output_cache(out_a), out_a.sequences,
                                                      max_optimistic_tokens=3, rebase="commit")),
        "blend": lambda: (ids, BlendCache(model, ids, spans, recompute_ratio=0.3)),
        "epic": lambda: (ids, EPICCache(model, ids, spans)),
    }[method]
    runs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        launches.clear()
        prompt, cache = make()
        out = model.generate(prompt, cache=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
        runs[name] = out, kv_of(cache)
        assert (len(launches) > 0) == (name == "triton")
    (ot, kvt), (orf, kvr) = runs["triton"], runs["torch"]
    assert torch.equal(ot.sequences, orf.sequences)
    for lt, lr in zip(ot.logits, orf.logits):
        torch.testing.assert_close(lt, lr, atol=1e-4, rtol=1e-4)
    for (kt, vt), (kr, vr) in zip(kvt, kvr):
        torch.testing.assert_close(kt, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vt, vr, atol=1e-5, rtol=1e-5)
