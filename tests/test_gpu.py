"""GPU checks (``pytest -m gpu``): the CUDA side-stream OptimisticCache, every cache on CUDA in bf16 with the Triton
kernels, and a model split between a GPU and the CPU. Run by ``scripts/gpu_check.sh`` on a CUDA machine; skipped
elsewhere, so CI never needs a GPU.

``HF_KVREUSE_GPU_TEST_DEVICE=cpu`` runs the same tests on the CPU (torch backend, no streams, the split between
``cpu`` and ``cpu``): a dry run of the test code itself on machines without a GPU.
"""

from __future__ import annotations

import copy
import gc
import os
import threading
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvreuse import (BlendCache, DirectReuseCache, EPICCache, OptimisticCache, TailRecomputeCache, enable,
                        output_cache)
from hf_kvreuse.devices import decoder_layers, layer_devices, offloaded
from hf_kvreuse.kv import kv_of

from cache_zoo import METHODS, CacheZoo

DEVICE = torch.device(os.environ.get("HF_KVREUSE_GPU_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """float32 comparisons need float32 matmuls (no TF32)."""
    if not ON_CUDA:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model(layers: int = 8, hidden: int = 1024, dtype=torch.float32):
    """A random-init Llama large enough that its exact prefill of a few thousand tokens outlasts a decode step."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), vocab_size=32000,
                      max_position_embeddings=16384, rope_theta=500000.0)
    return enable(LlamaForCausalLM(cfg).to(device=DEVICE, dtype=dtype).eval())


def _prompts(shared: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(3, 32000, (1, n), generator=g)  # noqa: E731
    q = r(shared)
    return torch.cat([r(32), q], 1).to(DEVICE), torch.cat([r(40), q], 1).to(DEVICE)


def _generate(model, ids, cache=None, new=24):
    kw = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True)
    return model.generate(ids, cache=cache, **kw) if cache is not None else model.generate(ids, **kw)


@pytest.fixture(scope="module")
def big():
    return _model(layers=8 if ON_CUDA else 2, hidden=1024 if ON_CUDA else 128)


def test_side_stream_exact_after_swap(big):
    """OptimisticCache decodes from the donor while the exact prefill runs on a side stream, swaps, and then
    continues exactly: every logit after the swap equals plain generate from the same tokens, and the returned
    cache equals a full prefill of the conversation. Records whether prefill and decode overlapped.

    Planted bug that fails it: ``BackgroundPrefill.result`` skips ``wait_event`` on the caller's stream (the
    swapped-in K/V are read before the side stream finished writing them)."""
    ids_a, ids_b = _prompts(4096 if ON_CUDA else 256)
    out_a = _generate(big, ids_a, new=8)
    cache = OptimisticCache(big, ids_b, output_cache(out_a), out_a.sequences, rebase="commit")
    out = _generate(big, ids_b, cache)
    st = cache.stats
    assert st.swap_step is not None, "the exact cache was never swapped in"
    n, k = ids_b.shape[1], st.swap_step
    if k < 24:
        ref = _generate(big, out.sequences[:, : n + k], new=24 - k)
        got = torch.stack(out.logits[k:]).float()
        want = torch.stack(ref.logits).float()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        assert torch.equal(out.sequences[:, n + k:], ref.sequences[:, n + k:])
    full = _generate(big, out.sequences[:, :-1], new=1)
    length = out.sequences.shape[1] - 1
    for (ck, cv), (rk, rv) in zip(kv_of(output_cache(out)), kv_of(output_cache(full))):
        torch.testing.assert_close(ck[..., :length, :], rk[..., :length, :], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(cv[..., :length, :], rv[..., :length, :], atol=2e-3, rtol=2e-3)
    print(f"\nswap after {k} optimistic tokens (overlap: {k > 0}), background {st.background_prefill_s} s, waited {st.wait_s} s")


def test_no_leaks_over_twenty_calls(big):
    """20 OptimisticCache calls: allocated memory returns to its level after each (no K/V, events or streams
    kept alive), no background thread outlives ``generate``, and every BackgroundPrefill is freed.

    Planted bug that fails it: OptimisticCache keeps a module-level list of its BackgroundPrefill jobs."""
    from hf_kvreuse.generation import background

    ids_a, ids_b = _prompts(1024 if ON_CUDA else 128, seed=1)
    out_a = _generate(big, ids_a, new=4)
    donor, donor_ids = output_cache(out_a), out_a.sequences
    threads0 = threading.active_count()
    made = []
    real_init = background.BackgroundPrefill.__init__

    def tracking_init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(weakref.ref(self))

    background.BackgroundPrefill.__init__ = tracking_init
    levels = []
    try:
        for _ in range(20):
            cache = OptimisticCache(big, ids_b, donor, donor_ids, rebase="commit")
            out = _generate(big, ids_b, cache, new=8)
            del cache, out
            gc.collect()
            if ON_CUDA:
                torch.cuda.synchronize()
                levels.append(torch.cuda.memory_allocated(DEVICE))
    finally:
        background.BackgroundPrefill.__init__ = real_init
    assert threading.active_count() <= threads0
    assert made and all(r() is None for r in made), "a BackgroundPrefill outlived its generate"
    if levels:
        assert max(levels[5:]) - levels[4] <= 1 << 20, f"memory grew over 20 calls: {levels}"


@pytest.fixture(scope="module")
def zoo_fp32():
    return CacheZoo(DEVICE, torch.float32)


@pytest.mark.parametrize("method", METHODS)
def test_every_cache_on_cuda_bf16(method, zoo_fp32):
    """Every cache runs on CUDA in bfloat16 with the default backend (``auto``: Triton on CUDA), its stats say
    ``triton``, and its first-step logits are no further from the float32 torch run than the torch backend's own
    bfloat16 run is (twice that, plus 0.05): the kernels add no error beyond bf16 rounding. The first token equals
    the torch backend's unless the float32 logits put the two tokens within that rounding of each other (a near
    tie that bf16 may flip: seen on an H200 for ``optimistic``, 0.07 apart).

    Planted bugs that fail it: ``kernels.backend`` returns ``"torch"`` for CUDA tensors under ``auto``; a Triton
    kernel that rotates by the wrong angle (its error then dwarfs bf16's)."""
    if method == "latent":
        from hf_kvreuse.compat import HAS_QUERY_OFFSET
        if not HAS_QUERY_OFFSET:
            pytest.skip("latent tokens need transformers>=5.17")
    zoo = CacheZoo(DEVICE, torch.bfloat16 if ON_CUDA else torch.float32)
    runs = {}
    for mode, z in (("auto", zoo), ("torch", zoo), ("ref", zoo_fp32)):
        os.environ["HF_KVREUSE_KERNELS"] = "torch" if mode == "ref" else mode
        try:
            runs[mode] = z.run(method)
        finally:
            os.environ.pop("HF_KVREUSE_KERNELS", None)
    # under auto on CUDA the choices are measured: "auto(kernel=backend, ...)"
    assert (runs["auto"]["kernels"].startswith("auto") if ON_CUDA else runs["auto"]["kernels"] == "torch")
    assert runs["torch"]["kernels"] == "torch"
    n = runs["torch"]["tokens"].shape[1] - runs["torch"]["logits"].shape[0]  # the prompt's length
    assert torch.equal(runs["auto"]["tokens"][:, :n], runs["torch"]["tokens"][:, :n])  # one prompt for both runs
    ref = runs["ref"]["logits"][0]
    err_torch = (runs["torch"]["logits"][0] - ref).abs().max().item()
    err_auto = (runs["auto"]["logits"][0] - ref).abs().max().item()
    # the first generated token (the former check compared only the prompt, which is the same input in both runs):
    # equal wherever the torch run's top-2 margin exceeds both runs' bf16 errors (a closer tie may flip honestly)
    top2 = runs["torch"]["logits"][0].float().topk(2, dim=-1).values
    if (top2[..., 0] - top2[..., 1]).min().item() > 2 * (err_auto + err_torch):
        assert torch.equal(runs["auto"]["tokens"][:, n], runs["torch"]["tokens"][:, n]), method
    assert err_auto <= 2 * err_torch + 5e-2, f"{method}: Triton bf16 error {err_auto:.3g}, torch bf16 {err_torch:.3g}"
    ta, tt = int(runs["auto"]["tokens"][0, n]), int(runs["torch"]["tokens"][0, n])
    assert ta == tt or abs(ref[ta] - ref[tt]).item() <= err_auto + err_torch, \
        f"{method}: first token {ta} (Triton) vs {tt} (torch), not a near tie in float32: {ref[ta]:.3f} vs {ref[tt]:.3f}"


@pytest.mark.parametrize("mode", ["verify", "gate", "latent"])
def test_cpu_prompt_on_a_cuda_model(mode, zoo_fp32):
    """A prompt left on the CPU (transformers accepts it for a CUDA model) gives the same tokens as the prompt on
    the GPU, for the caches whose own forwards and logits processors read generate's sequence: OptimisticCache
    under ``rebase="verify"`` and under a gate with a repetition penalty (a processor that indexes the logits with
    the ids), and LatentRemedyCache (its position ids).

    Planted bug that fails it (on a GPU): ``KVReuseGenerationMixin.generate`` leaves the prompt where the caller put
    it (``_to_input_device`` removed): the caches mix CPU ids with CUDA logits and K/V."""
    from hf_kvreuse import ChunkStore, LatentRemedyCache
    from hf_kvreuse.compat import HAS_QUERY_OFFSET
    from hf_kvreuse.models.arch_zoo import agent_prompts, rag_prompt

    if mode == "latent" and not HAS_QUERY_OFFSET:
        pytest.skip("latent tokens need transformers>=5.17")
    m = zoo_fp32.model
    gen = dict(max_new_tokens=6, do_sample=False, repetition_penalty=1.3)
    outs = []
    for where in (DEVICE, torch.device("cpu")):
        if mode == "latent":
            ids, spans = rag_prompt(2)
            cache = LatentRemedyCache(m, ids.to(DEVICE), spans, bridge=zoo_fp32.bridge, store=ChunkStore())
        else:
            ids_a, ids = agent_prompts(4)
            out_a = m.generate(ids_a.to(DEVICE), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
            kw = dict(rebase="verify") if mode == "verify" else dict(gate=0.5)
            cache = OptimisticCache(m, ids.to(DEVICE), output_cache(out_a), out_a.sequences,
                                    **{"rebase": "commit", **kw})
        from hf_kvreuse.generation.background import BackgroundPrefill
        ready, BackgroundPrefill.ready = BackgroundPrefill.ready, lambda self: False  # the same swap step in both
        try:
            outs.append(m.generate(ids.to(where), cache=cache, **gen).cpu())
        finally:
            BackgroundPrefill.ready = ready
    assert torch.equal(outs[0], outs[1])


def _split(model, second: torch.device):
    """Layers of the second half compute on ``second``: accelerate's hooks, as ``dispatch_model`` installs them for
    a device_map over two devices (the cache passes through untouched: ``skip_keys``). Embeddings, the final norm
    and the head stay on the first device, so logits come back where ``generate`` keeps its tokens."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    skip = ["past_key_values", "past_key_value"]
    layers = decoder_layers(model)
    half = len(layers) // 2
    for i, layer in enumerate(layers):
        dev = DEVICE if i < half else second
        layer.to(dev)
        add_hook_to_module(layer, AlignDevicesHook(execution_device=dev, io_same_device=False, skip_keys=skip))
    for module in (model.model.norm, model.lm_head):
        add_hook_to_module(module, AlignDevicesHook(execution_device=DEVICE, io_same_device=False))
    return model


@pytest.fixture(scope="module")
def split_pair():
    ref = _model(layers=4, hidden=256)
    return ref, _split(copy.deepcopy(ref), torch.device("cpu"))


@pytest.mark.parametrize("method", ["direct", "blend", "epic", "tail", "optimistic"])
def test_device_map_split(split_pair, method):
    """A model whose first layers run on the GPU and the rest on the CPU: every cache keeps each layer's K/V on
    that layer's device and gives the single-device model's tokens and logits.

    Planted bug that fails it: ``devices.layer_devices`` returns layer 0's device for every layer (assembly then
    indexes CPU layers with CUDA rows: device-mismatch error)."""
    ref, split = split_pair
    assert layer_devices(split)[-1] == torch.device("cpu") and not offloaded(split)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 32000, (1, 60), generator=g).to(DEVICE)
    spans = [(6, 26), (28, 48)]
    outs = {}
    for name, model in (("ref", ref), ("split", split)):
        if method == "optimistic":
            ids_a = torch.cat([torch.randint(3, 32000, (1, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE),
                               ids[:, 6:48]], 1)
            out_a = _generate(model, ids_a, new=3)
            from hf_kvreuse.generation.background import BackgroundPrefill
            ready = BackgroundPrefill.ready
            BackgroundPrefill.ready = lambda self: False  # swap at step 3 in both runs
            try:
                cache = OptimisticCache(model, ids, output_cache(out_a), out_a.sequences, max_optimistic_tokens=3,
                                        rebase="commit")
                outs[name] = _generate(model, ids, cache, new=6), cache
            finally:
                BackgroundPrefill.ready = ready
        else:
            cls = {"direct": DirectReuseCache, "blend": BlendCache, "epic": EPICCache, "tail": TailRecomputeCache}
            cache = cls[method](model, ids, spans)
            outs[name] = _generate(model, ids, cache, new=6), cache
    (ref_out, _), (out, cache) = outs["ref"], outs["split"]
    assert torch.equal(out.sequences.cpu(), ref_out.sequences.cpu())
    torch.testing.assert_close(torch.stack(out.logits).float().cpu(), torch.stack(ref_out.logits).float().cpu(),
                               atol=1e-3, rtol=1e-3)
    devs = layer_devices(split)
    for (k, v), d in zip(kv_of(output_cache(out)), devs):
        assert k.device == d and v.device == d


def test_offloaded_model_refused_for_background_prefill():
    """An offloaded model (weights on the CPU, moved in per forward) is refused by OptimisticCache's background
    prefill with a clear error, and runs with ``max_optimistic_tokens=0`` (synchronous exact prefill).

    Planted bug that fails it: ``devices.offloaded`` looks only at the top-level module's hook."""
    if not ON_CUDA:
        pytest.skip("offloading moves weights to a GPU")
    from accelerate import cpu_offload

    model = _model(layers=2, hidden=128)
    cpu_offload(model, execution_device=DEVICE)
    assert offloaded(model)
    ids_a, ids_b = _prompts(64, seed=5)
    out_a = _generate(model, ids_a, new=2)
    with pytest.raises(ValueError, match="offload"):
        OptimisticCache(model, ids_b, output_cache(out_a), out_a.sequences, rebase="commit")
    cache = OptimisticCache(model, ids_b, output_cache(out_a), out_a.sequences, max_optimistic_tokens=0,
                            rebase="commit")
    assert torch.equal(_generate(model, ids_b, cache, new=4).sequences, _generate(model, ids_b, new=4).sequences)
