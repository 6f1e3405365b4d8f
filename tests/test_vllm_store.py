"""hf_kvreuse.vllm without vLLM: the K/V store (verified reads), model identity, the claim plan, the paged-layout
check and the transformers side (tiny models). The engine itself is tested in tests_vllm/ (``make test-vllm``)."""

import sys

import pytest
import torch

from hf_kvreuse.artifacts import CorruptArtifactError
from hf_kvreuse.generation.mixin import enable
from hf_kvreuse.models import tiny_model
from hf_kvreuse.session import ReuseSession
from hf_kvreuse.vllm import (KVDirStore, ModelIdentity, ModelMismatchError, PagedLayout, UnknownLayoutError,
                             detect_layout, plan_claim)
from hf_kvreuse.vllm.hf import load_prefix, save_cache, to_session
from hf_kvreuse.vllm.identity import folder_identity, hf_model_identity

from conftest import assert_kv_close, exact_prefill

ID = ModelIdentity("a" * 64, "float32", "/m")
OTHER = ModelIdentity("b" * 64, "float32", "/other")


def toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def kv_tensors(n, layers=2, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, heads, n, dim, generator=g), torch.randn(layers, heads, n, dim, generator=g)


def test_import_does_not_import_vllm():
    """``import hf_kvreuse`` and ``hf_kvreuse.vllm`` (everything but the connector module) import no vLLM module,
    so the library and this package work where vLLM is not installed (this suite never imports vLLM itself)."""
    import hf_kvreuse.vllm.hf  # noqa: F401

    bad = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.") or m == "hf_kvreuse.vllm.connector"]
    assert not bad, bad


def test_store_round_trip_and_prefix(tmp_path):
    """An entry reads back bit for bit; the longest exact prefix stops at ``exact_len`` and at the first differing
    token; entries of another model identity are never offered.

    Planted bug that fails it: ``longest_exact_prefix`` compares ``e.token_ids`` instead of ``e.token_ids[:e.exact_len]``
    (approximate rows offered as an exact prefix)."""
    store = KVDirStore(tmp_path)
    ids = list(range(10, 30))
    k, v = kv_tensors(20)
    info = store.put(ID, ids, k, v, exact_len=12)
    k2, v2 = store.load(info, ID)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    e, n = store.longest_exact_prefix(ID, ids + [5])
    assert e.entry_id == info.entry_id and n == 12
    assert store.longest_exact_prefix(ID, ids[:5] + [1] + ids[6:])[1] == 5
    assert store.longest_exact_prefix(OTHER, ids)[0] is None
    with pytest.raises(ModelMismatchError):
        store.load(info, OTHER)


@pytest.mark.parametrize("damage", ["tensor_bytes", "token_ids", "exact_len", "shape"])
def test_corrupted_entry_is_refused(tmp_path, damage):
    """A changed tensor file, token list or ``exact_len``, or a tensor of another shape, is refused (never loaded):
    the JSON's self-digest and the tensor file's sha256 are checked on every read.

    Planted bug that fails it: ``KVDirStore._info_of`` skips the ``check_signed`` check (an edited token list then
    makes the rows serve as the K/V of other tokens)."""
    import json

    store = KVDirStore(tmp_path)
    ids = list(range(40, 56))
    info = store.put(ID, ids, *kv_tensors(16))
    js = tmp_path / f"{info.entry_id}.json"
    st = tmp_path / json.loads(js.read_text())["file"]
    if damage == "tensor_bytes":
        raw = bytearray(st.read_bytes())
        raw[-7] ^= 0x40
        st.write_bytes(bytes(raw))
        with pytest.raises(CorruptArtifactError):
            store.load(info, ID)
        return
    meta = json.loads(js.read_text())
    if damage == "token_ids":
        meta["token_ids"][3] += 1
    elif damage == "exact_len":
        meta["exact_len"] = 99
    else:
        meta["head_dim"] = 8
    js.write_text(json.dumps(meta))
    assert store.info(info.entry_id) is None and info.entry_id in store.refused
    assert store.entries() == []
    with pytest.raises(CorruptArtifactError):
        store.load(info, ID)


def test_put_refuses_dtype_of_another_identity(tmp_path):
    """K/V of one dtype are not stored under an identity of another (bf16 K/V of fp32 weights differ)."""
    k, v = kv_tensors(4)
    with pytest.raises(ModelMismatchError):
        KVDirStore(tmp_path).put(ModelIdentity("a" * 64, "bfloat16"), [1, 2, 3, 4], k, v)


def _entry(store, ids, exact_len=None, identity=ID):
    return store.put(identity, ids, *kv_tensors(len(ids)), exact_len=exact_len)


def test_plan_exact_prefix_block_rule(tmp_path):
    """The claim is the longest exact prefix cut down to whole blocks and never includes the last prompt token.

    Planted bug that fails it: ``limit = len(tokens)`` in ``plan_claim`` (a prompt fully in the store would leave
    vLLM no token to compute logits from)."""
    store = KVDirStore(tmp_path)
    a = list(range(100, 180))                       # 80 tokens
    _entry(store, a)
    c = plan_claim(a[:70] + [1, 2, 3], store.entries(), block_size=32)
    assert (c.end, c.exact_end, c.spans_used) == (64, 64, 0)
    assert [(p.target_start, p.length, p.donor_start) for p in c.pieces] == [(0, 64, 0)]
    assert plan_claim(a[:64], store.entries(), 32).end == 32      # 63 claimable tokens -> one block
    assert plan_claim(a[:20], store.entries(), 32).end == 0
    assert plan_claim([7] + a, store.entries(), 32).end == 0       # no common prefix


def test_plan_spans_continue_the_prefix_without_gap(tmp_path):
    """Re-positioned spans are claimed only where they continue the covered run: a span after a gap is never
    supplied (vLLM's claim is a prefix); spans are marked inexact and carry their position shift."""
    store = KVDirStore(tmp_path)
    sys_p = list(range(200, 232))                   # 32 shared system tokens
    doc = list(range(300, 364))                     # 64 document tokens
    _entry(store, sys_p + [5, 6, 7] + doc)          # the doc at donor positions 35..99
    req = sys_p + [8, 9] + doc + [1, 2]             # the doc at target positions 34..98
    c = plan_claim(req, store.entries(), 32, spans=True, min_span=16)
    assert (c.end, c.exact_end, c.spans_used) == (32, 32, 0)  # the new tokens 32..34 are a gap: no span follows
    c = plan_claim(sys_p + doc + [1, 2], store.entries(), 32, spans=True, min_span=16)
    assert c.end == 96 and c.exact_end == 32
    span = [p for p in c.pieces if not p.exact][0]
    assert (span.target_start, span.donor_start, span.delta) == (32, 35, -3)
    assert not plan_claim(sys_p + doc + [1, 2], store.entries(), 32, spans=False).spans_used


def _fake_kernel(layout: str):
    """A write kernel storing tokens in ``layout`` ("kt_v", "k_v", or "scrambled": keys with heads swapped)."""
    def write(key, value, layer, slots):
        nb, H, B, D2 = layer.shape
        D = D2 // 2
        for t, s in enumerate(slots.tolist()):
            b, o = divmod(s, B)
            flat = layer[b].view(H, 2 * B * D)
            kk = key[t].flip(0) if layout == "scrambled" else key[t]
            if layout == "k_v":
                flat[:, :B * D].view(H, B, D)[:, o] = kk
            else:
                flat[:, :B * D].view(H, D, B)[:, :, o] = kk
            flat[:, B * D:].view(H, B, D)[:, o] = value[t]
    return write


@pytest.mark.parametrize("name", ["kt_v", "k_v"])
def test_detect_layout_and_token_moves(name):
    """The layout a kernel writes is found by probing it, and ``PagedLayout.write`` / ``read`` then move single
    tokens exactly as the kernel stores them (mid-block, across a block boundary).

    Planted bug that fails it: ``_halves`` reads the ``kt_v`` keys as ``view(H, B, D)`` (rows as tokens: the CPU
    backend's transposed keys read wrong)."""
    H, B, D = 2, 8, 4
    kernel = _fake_kernel(name)
    layout = detect_layout(kernel, H, B, D, torch.float32)
    assert layout.name == name
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(11, H, D, generator=g), torch.randn(11, H, D, generator=g)
    by_kernel, by_layout = torch.zeros(4, H, B, 2 * D), torch.zeros(4, H, B, 2 * D)
    blocks = [2, 0, 3]
    slots = torch.tensor([blocks[(5 + t) // B] * B + (5 + t) % B for t in range(11)])
    kernel(key, value, by_kernel, slots)
    layout.write(by_layout, blocks, 5, key.transpose(0, 1), value.transpose(0, 1))
    assert torch.equal(by_kernel, by_layout)
    k, v = layout.read(by_kernel, blocks, 5, 16)
    assert torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1))


def test_unknown_layout_is_refused():
    """A kernel that stores K/V in no known layout (or fails) is refused with UnknownLayoutError naming it."""
    with pytest.raises(UnknownLayoutError, match="match none"):
        detect_layout(_fake_kernel("scrambled"), 2, 8, 4, torch.float32)

    def broken(key, value, layer, slots):
        raise RuntimeError("no such op")

    with pytest.raises(UnknownLayoutError, match="no such op"):
        detect_layout(broken, 2, 8, 4, torch.bfloat16)
    with pytest.raises(UnknownLayoutError):
        PagedLayout("k_v", 8, 2, 4).check(torch.zeros(3, 2, 16, 8))


# -- the transformers side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama saved to a folder (what vLLM would load) and loaded back from it."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return enable(model), folder


def test_identity_checks_weights_against_folder(saved, tmp_path):
    """A model's identity is its folder's only when every weight equals the folder's: a weight changed in memory
    (or another model's folder) is refused, and fp32 / bf16 runs of one folder are different identities.

    Planted bug that fails it: ``check_weights_match`` never compares values (``torch.equal`` replaced by True)."""
    model, folder = saved
    ident = hf_model_identity(model, folder)
    assert ident.key == folder_identity(folder, torch.float32).key
    assert ident.key != folder_identity(folder, torch.bfloat16).key
    other = tiny_model("llama", seed=5)
    with pytest.raises(ModelMismatchError, match="differs"):
        hf_model_identity(other, folder)
    with pytest.raises(FileNotFoundError):
        folder_identity(tmp_path, torch.float32)


def test_hf_prefix_round_trip_and_session(saved, tmp_path):
    """K/V written from a transformers prefill come back as the exact prefix of a longer prompt (generate with it
    gives plain generate's logits), and feed a ReuseSession as a held exact cache.

    Planted bug that fails it: ``unstack_kv`` returns ``v`` for both keys and values."""
    model, folder = saved
    store = KVDirStore(tmp_path)
    ids = toks(40, 3)
    cache, _ = exact_prefill(model, ids)
    save_cache(store, model, ids, cache, folder=folder)
    longer = torch.cat([ids, toks(6, 4)], 1)
    pre, n = load_prefix(store, model, longer, folder=folder)
    assert n == 40
    assert_kv_close(pre, cache)
    gen = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    mask = torch.ones_like(longer)
    ref = model.generate(longer, attention_mask=mask, **gen)
    got = model.generate(longer, attention_mask=mask, past_key_values=pre, **gen)
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    session = ReuseSession(model, policy="prefix")
    assert to_session(store, session, folder=folder) == 1
    out = session.generate(longer, max_new_tokens=4, do_sample=False)
    assert session.last_stats.exact_prefix_tokens == 40
    assert torch.equal(out, ref.sequences)
    with pytest.raises(ModelMismatchError):
        to_session(store, ReuseSession(enable(tiny_model("llama", seed=5))), folder=folder)


def test_hf_loaders_put_each_layer_on_its_device(saved, tmp_path, monkeypatch):
    """A model split over devices gets each layer's K/V on that layer's device from ``load_prefix`` (``meta``
    stands in for a second device here, as in tests/test_devices.py).

    Planted bug that fails it: the loaders move every layer to the first parameter's device (the code before this
    change)."""
    from hf_kvreuse.kv import kv_of
    from hf_kvreuse.vllm import hf

    model, folder = saved
    store = KVDirStore(tmp_path)
    ids = toks(20, 3)
    cache, _ = exact_prefill(model, ids)
    save_cache(store, model, ids, cache, folder=folder)
    n_layers = model.config.num_hidden_layers
    devices = [torch.device("cpu")] * (n_layers // 2) + [torch.device("meta")] * (n_layers - n_layers // 2)
    monkeypatch.setattr(hf, "layer_devices", lambda m: devices)
    pre, n = load_prefix(store, model, torch.cat([ids, toks(3, 4)], 1), folder=folder)
    assert n == 20 and [k.device for k, _ in kv_of(pre)] == devices == [v.device for _, v in kv_of(pre)]
