import pytest
import torch

from hf_kvreuse import KVReuseCache
from hf_kvreuse.generation import partial_forward
from hf_kvreuse.generation.partial import position_causal_mask
from hf_kvreuse.kv import cat_kv, empty_kv, kv_length, kv_of, load_kv, scatter_kv, slice_kv


from conftest import assert_kv_close, exact_prefill as _prefill


def test_slice_cat_scatter_round_trip(llama):
    """Slicing, concatenating and scattering K/V round-trip to the original tensors.

    Planted bug that fails it: ``scatter_kv`` copies the source keys into the values (``dv.index_copy_(-2, i, sk)``)."""
    ids = torch.randint(3, 128, (1, 20))
    cache, _ = _prefill(llama, ids)
    kv = kv_of(cache)
    a, b = slice_kv(cache, slice(0, 7)), slice_kv(cache, torch.arange(7, 20))
    whole = cat_kv(a, b)
    for (k, v), (k2, v2) in zip(kv, whole):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    dst = empty_kv(kv, 20)
    perm = torch.randperm(20)
    scatter_kv(dst, perm, slice_kv(kv, perm))
    for (k, v), (k2, v2) in zip(kv, dst):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert kv_length(dst) == 20


def test_mask_equals_dense_reference():
    """Planted bug that fails it: ``position_causal_mask`` compares ``col_pos < row_pos`` (a row cannot see itself)."""
    pos = torch.tensor([0, 1, 2, 5, 6, 9])
    rows = torch.tensor([1, 3, 5])
    valid = torch.tensor([True, True, False, True, True, True])
    mask = position_causal_mask(pos[rows], pos, torch.float32, valid)[0, 0]
    dense = torch.full((3, 6), torch.finfo(torch.float32).min)
    for j, r in enumerate(rows.tolist()):
        for i in range(6):
            if pos[i] <= pos[r] and valid[i]:
                dense[j, i] = 0
    assert torch.equal(mask, dense)


def test_partial_forward_all_rows_equals_full_prefill(arch_model):
    """Planted bug that fails it: ``position_causal_mask`` compares ``col_pos < row_pos`` (logits differ)."""
    ids = torch.randint(3, 128, (1, 24))
    ref, ref_logits = _prefill(arch_model, ids)
    kv = empty_kv(kv_of(ref), 24)
    out = partial_forward(arch_model, ids, torch.arange(24), kv, logits_to_keep=0)
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert_kv_close(kv, ref)


def test_partial_forward_rows_on_exact_cache_are_exact(arch_model):
    """Recomputing any row subset on top of exact K/V reproduces those rows (no future leak).

    Planted bug that fails it: ``position_causal_mask`` allows every column (the research code's future leak).
    (``_ScatterCache.update`` returning only the new rows fails it too, by a mask size error.)"""
    ids = torch.randint(3, 128, (1, 30))
    ref, _ = _prefill(arch_model, ids)
    kv = [(k.clone(), v.clone()) for k, v in kv_of(ref)]
    rows = torch.tensor([0, 3, 4, 17, 29])
    garbage = [(torch.randn_like(k[..., rows, :]), torch.randn_like(v[..., rows, :])) for k, v in kv]
    scatter_kv(kv, rows, garbage)
    partial_forward(arch_model, ids, rows, kv)
    assert_kv_close(kv, ref)


def test_logical_length_of_compressed_cache(llama):
    """A cache physically holding fewer entries than tokens: generate feeds only new tokens (HF_API F2)."""
    from hf_kvreuse.compat import HAS_QUERY_OFFSET

    if not HAS_QUERY_OFFSET:
        pytest.skip("a cache with logical_offset != 0 needs transformers>=5.17 (Cache.get_query_offset)")
    ids = torch.randint(3, 128, (1, 16))
    full, _ = _prefill(llama, ids[:, :15])
    keep = torch.tensor([0, 1, 2, 3, 11, 12, 13, 14])  # 4 sink + last 4 of the 15 cached tokens
    cache = KVReuseCache(llama)
    load_kv(cache, slice_kv(full, keep))
    cache.logical_offset = 15 - keep.numel()
    assert cache.get_seq_length() == 15 and cache.get_query_offset() == keep.numel()
    out = llama.generate(ids, cache=cache, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == 21
    assert cache.physical_length() == keep.numel() + 5  # last prompt token + 4 fed generated tokens


def test_layer_ranges_compose_to_full_prefill(arch_model):
    """Layers [0, c) for all rows, then [c, L) for all rows == one full forward (the engine's layer path).

    Planted bug that fails it: ``partial_forward`` with ``layers=`` never applies the final norm (``return h``)."""
    ids = torch.randint(3, 128, (1, 20))
    ref, ref_logits = _prefill(arch_model, ids)
    kv = empty_kv(kv_of(ref), 20)
    rows = torch.arange(20)
    n_layers = arch_model.config.num_hidden_layers
    h = partial_forward(arch_model, ids, rows, kv, layers=range(0, 1))
    h = partial_forward(arch_model, ids, rows, kv, layers=range(1, n_layers), hidden_states=h)
    torch.testing.assert_close(arch_model.lm_head(h), ref_logits, atol=1e-4, rtol=1e-4)
    assert_kv_close(kv, ref)


def test_layer_range_subset_rows_is_exact_on_exact_cache(arch_model):
    """CacheBlend's shape: all rows through layer 0, a row subset through the rest, on exact K/V elsewhere.

    Planted bug that fails it: ``run_layers`` computes RoPE at positions ``0..R-1`` instead of ``position_ids``
    (all-rows ranges, as in the test above, do not see it)."""
    ids = torch.randint(3, 128, (1, 24))
    ref, _ = _prefill(arch_model, ids)
    kv = [(k.clone(), v.clone()) for k, v in kv_of(ref)]
    rows = torch.tensor([2, 9, 10, 23])
    scatter_kv(kv, rows, [(torch.zeros_like(k[..., rows, :]), torch.zeros_like(v[..., rows, :])) for k, v in kv])
    h = partial_forward(arch_model, ids, torch.arange(24), kv, layers=range(0, 1))
    partial_forward(arch_model, ids, rows, kv, layers=range(1, arch_model.config.num_hidden_layers),
                    hidden_states=h[:, rows])
    assert_kv_close(kv, ref)
