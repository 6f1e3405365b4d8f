"""Memory: what each cache keeps alive after a call, and no growth across many calls (tiny models, fast).

Live memory is counted as the bytes of the distinct tensor storages reachable by the garbage collector, which
does not depend on the allocator (resident memory would also count what glibc keeps mapped).
"""

import gc
import threading
import time
import weakref

import pytest
import torch

from hf_kvreuse import BlendCache, ChunkStore, DirectReuseCache, OptimisticCache, enable
from hf_kvreuse.compat import output_cache
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.kv import copy_shifted_, kv_nbytes, kv_of, release_kv
from hf_kvreuse.models import tiny_model
from hf_kvreuse.rope import RopeShifter
from hf_kvreuse.timing import PeakMemory, malloc_trim

from conftest import agent_prompts

GEN = dict(max_new_tokens=6, do_sample=False)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach (after a full collection)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                st = obj.untyped_storage()
            except RuntimeError:  # meta / sparse tensors have no storage
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama"))


def _donor(model, ids):
    out = model.generate(ids, return_dict_in_generate=True, **GEN)
    return output_cache(out), out.sequences


def _chain_growth(model, calls: int, **kw) -> int:
    """Live tensor bytes after ``calls`` consecutive OptimisticCache calls minus after 3 warm-up calls.

    Every call is the next agent of a chain: its donor is the previous call's output, and only the last output
    is kept, so a correct library holds the same bytes after every call.
    """
    ids_a, ids_b = agent_prompts(3, shared=120)
    donor = _donor(model, ids_a)
    prompts = [ids_b, ids_a]

    def step(i, donor):
        ids = prompts[i % 2]
        cache = OptimisticCache(model, input_ids=ids, donor_cache=donor[0], donor_ids=donor[1],
                                max_optimistic_tokens=2, **{"rebase": "commit", **kw})
        out = model.generate(ids, cache=cache, return_dict_in_generate=True, **GEN)
        return output_cache(out), out.sequences

    for i in range(3):
        donor = step(i, donor)
    before = live_tensor_bytes()
    for i in range(3, 3 + calls):
        donor = step(i, donor)
    return live_tensor_bytes() - before


@pytest.mark.parametrize("release", [False, True])
def test_no_growth_over_50_optimistic_calls(model, release):
    """50 consecutive OptimisticCache calls (a chain of agents) hold no more live tensor bytes than 3 calls.

    This test fails if something keeps a reference to each call's K/V, e.g. the planted bug of
    :func:`test_leak_check_catches_a_planted_leak` (every exact cache appended to a module-level list at the
    swap): there the growth is ~50 caches' worth.
    """
    assert _chain_growth(model, 50, release_donor=release) <= 0
    assert not any(t.name == "hf_kvreuse-prefill" and t.is_alive() for t in threading.enumerate())


def test_leak_check_catches_a_planted_leak(model, monkeypatch):
    """The leak check above can fail: plant a leak (each swap keeps the exact K/V in a global list)."""
    kept = []
    orig = OptimisticCache._swap_in

    def leaky_swap_in(self, input_ids):
        feed = orig(self, input_ids)
        kept.append([(k, v) for k, v in kv_of(self)])  # the planted bug
        return feed

    monkeypatch.setattr(OptimisticCache, "_swap_in", leaky_swap_in)
    growth = _chain_growth(model, 50)
    one_cache = kv_nbytes(kept[-1])
    assert growth >= 40 * one_cache


def test_no_growth_over_50_block_cache_calls(model):
    """50 DirectReuseCache / BlendCache calls over the same stored blocks hold no more live bytes than 3."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, 150), generator=g)
    spans = [(10, 60), (70, 120)]
    store = ChunkStore()

    def step():
        for cls in (DirectReuseCache, BlendCache):
            out = model.generate(ids, cache=cls(model, ids, spans, store=store), **GEN)
        return out

    for _ in range(3):
        step()
    before = live_tensor_bytes()
    for _ in range(50):
        step()
    assert live_tensor_bytes() - before <= 0
    assert len(store) == 2 and store.misses == 2


def test_optimistic_kv_freed_at_the_swap(model, monkeypatch):
    """After the swap nothing holds the optimistic K/V, and the job no longer holds the exact ones."""
    refs = []
    orig_assemble, orig_swap = OptimisticCache._assemble, OptimisticCache._swap_in
    seen = {}

    def assemble(self):
        orig_assemble(self)
        refs.extend(weakref.ref(t) for k, v in kv_of(self) for t in (k, v))

    def swap_in(self, input_ids):
        feed = orig_swap(self, input_ids)
        gc.collect()
        seen["alive_after_swap"] = sum(r() is not None for r in refs)
        seen["job_cache"] = self.job._cache
        return feed

    monkeypatch.setattr(OptimisticCache, "_assemble", assemble)
    monkeypatch.setattr(OptimisticCache, "_swap_in", swap_in)
    ids_a, ids_b = agent_prompts(1, shared=80)
    donor = _donor(model, ids_a)
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=donor[0], donor_ids=donor[1], max_optimistic_tokens=3,
                            rebase="commit")
    model.generate(ids_b, cache=cache, **GEN)
    assert cache.stats.swap_step is not None and cache.stats.exact
    assert refs and seen["alive_after_swap"] == 0
    assert seen["job_cache"] is None


def test_release_donor(model, monkeypatch):
    """release_donor=True frees the donor's K/V although the caller still holds the donor cache object.

    Both runs swap at step 3 (``ready`` is held False), so their tokens cannot depend on when the background
    prefill happens to finish.
    """
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    ids_a, ids_b = agent_prompts(2, shared=80)
    out_a = model.generate(ids_a, return_dict_in_generate=True, **GEN)
    donor = output_cache(out_a)
    refs = [weakref.ref(t) for k, v in kv_of(donor) for t in (k, v)]
    ref_out = model.generate(ids_b, cache=OptimisticCache(model, input_ids=ids_b, donor_cache=donor,
                                                          donor_ids=out_a.sequences, max_optimistic_tokens=3,
                                                              rebase="commit"), **GEN)
    assert all(r() is not None for r in refs)  # default: the donor is read, never modified
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=donor, donor_ids=out_a.sequences, release_donor=True,
                            max_optimistic_tokens=3, rebase="commit")
    out = model.generate(ids_b, cache=cache, **GEN)
    gc.collect()
    assert cache.stats.swap_step == 3
    assert torch.equal(out, ref_out)
    assert all(r() is None for r in refs)
    assert all(k.numel() == 0 for k, _ in kv_of(donor))


def test_release_donor_without_assembly(model):
    """max_optimistic_tokens=0 never assembles; the donor is still released when generate returns."""
    ids_a, ids_b = agent_prompts(2, shared=40)
    donor, dids = _donor(model, ids_a)
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=donor, donor_ids=dids, max_optimistic_tokens=0,
                            release_donor=True, rebase="commit")
    model.generate(ids_b, cache=cache, **GEN)
    assert all(k.numel() == 0 for k, _ in kv_of(donor))


def test_copy_shifted_equals_rope_shift(model):
    """The in-place, chunked re-positioning gives exactly RopeShifter.shift's numbers."""
    sh = RopeShifter(model)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 37, 16, generator=g)
    for delta in (0, 5, -17, 1000):
        dst = torch.full_like(k, float("nan"))
        copy_shifted_(dst, k, sh, delta, chunk=8)
        assert torch.equal(dst, sh.shift(k, delta))


def test_release_kv_on_a_list():
    kv = [(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))]
    release_kv(kv)
    assert kv[0][0].numel() == 0 and kv[0][1].numel() == 0


def test_peak_memory_sees_a_transient_allocation():
    """PeakMemory (CPU): 64 MiB touched and freed inside the block shows as peak, not as end growth.

    The buffer is an anonymous mapping unmapped at ``close``, so the allocator's policy (a heap that keeps freed
    memory, a raised mmap threshold after earlier tests) cannot hold it past the block."""
    import mmap

    malloc_trim()
    with PeakMemory(interval_s=0.001) as mem:
        buf = mmap.mmap(-1, 64 * 2**20)
        for off in range(0, len(buf), mmap.PAGESIZE):
            buf[off] = 1  # touch every page: resident
        # at least one whole sample while it is resident: wait for the sampler thread to take two more samples
        # (a fixed sleep assumed the thread gets scheduled within it, which a loaded machine does not promise)
        seen, hang_guard = mem.samples, time.monotonic() + 120
        while mem.samples < seen + 2 and time.monotonic() < hang_guard:
            time.sleep(0.001)
        buf.close()
    assert mem.peak_bytes >= 60 * 2**20
    assert mem.end_bytes < 32 * 2**20
    assert mem.samples > 0
