"""Files and identity that are never silently wrong: every file the library reads back stays inside its folder, is
checked against its recorded digest (manifests against their own), is paired with the JSON of the writer that
wrote it, and is rewritten when damaged; K/V are keyed by the weights' bytes and every config field that changes
them; a saved session's cache options come back."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_kvreuse import ChunkStore, DiskTier, PersistedKVError, ReuseSession, enable
from hf_kvreuse.models import tiny_model

GEN = dict(max_new_tokens=4, do_sample=False)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def toks(n, seed):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# -- 1. containment: names from a manifest never leave its folder -------------------------------------------------
HOSTILE = st.one_of(
    st.sampled_from(["ABS", "../victim.txt", "../../victim.txt", "./../victim.txt", "LINK", "..", ".", ""]),
    st.text(alphabet="./\\abc", min_size=1, max_size=12).filter(lambda s: "/" in s or "\\" in s or s in ("..",)),
)


def _hostile_name(kind: str, folder: Path, victim: Path) -> str:
    if kind == "ABS":
        return str(victim)
    if kind == "LINK":
        link = folder / "link.safetensors"
        if not link.exists():
            link.symlink_to(victim)
        return link.name
    return kind


@FAST
@given(kind=HOSTILE)
def test_disk_tier_never_deletes_or_reads_outside_its_folder(llama, tmp_path_factory, kind):
    """An old chunk JSON naming a file outside ``chunks/`` (absolute, ``..``, a symlink out) is neither deleted by
    the budget pass nor read by ``get``; the file outside survives any number of puts over budget.

    Planted bug that fails it: ``DiskTier._enforce_budget`` deletes ``self.folder / meta["file"]`` without
    :func:`hf_kvreuse.safe_files.inside` (the file outside the folder is deleted)."""
    tmp = tmp_path_factory.mktemp("tier")
    victim = tmp / "victim.txt"
    victim.write_text("not a chunk")
    tier = DiskTier(tmp / "store", max_bytes=1)
    name = _hostile_name(kind, tier.folder, victim)
    bad = tier.folder / "0000old.json"
    bad.write_text(json.dumps({"file": name, "format": "hf_kvreuse.chunk", "version": 1, "sha256": "0"}))
    os.utime(bad, (time.time() - 3600, time.time() - 3600))
    tier.max_bytes = 20_000
    store = ChunkStore(disk=tier)
    for i in range(3):
        store.get_or_compute(llama, toks(16, 30 + i))
    assert victim.read_text() == "not a chunk"


def test_disk_tier_get_refuses_a_name_outside_and_an_edited_json(llama, tmp_path):
    """``DiskTier.get`` refuses a chunk JSON naming a file outside the folder, and one whose fields were edited (its
    own digest), with :class:`PersistedKVError`.

    Planted bug that fails it: ``DiskTier.get`` skips ``check_signed`` (an edited ``start`` is then trusted)."""
    tier = DiskTier(tmp_path / "store")
    store = ChunkStore(disk=tier)
    ids = toks(16, 3)
    store.get_or_compute(llama, ids)
    (meta_path,) = tier.folder.glob("*.json")
    meta = json.loads(meta_path.read_text())
    edited = dict(meta, start=5)
    meta_path.write_text(json.dumps(edited))
    with pytest.raises(PersistedKVError, match="sha256|signature"):
        ChunkStore(disk=DiskTier(tmp_path / "store")).get(llama, ids)
    outside = tmp_path / "x.safetensors"
    outside.write_bytes((tier.folder / meta["file"]).read_bytes())
    meta_path.write_text(json.dumps(dict(meta, file=str(outside))))
    with pytest.raises(PersistedKVError, match="leaves its folder|sha256|signature"):
        ChunkStore(disk=DiskTier(tmp_path / "store")).get(llama, ids)


@FAST
@given(field=st.sampled_from(["exact", "producer", "sha256", "file", "tokens"]), kind=HOSTILE)
def test_session_manifest_is_signed_and_contained(llama, tmp_path_factory, field, kind):
    """An edited session manifest (an entry's ``exact``, ``producer``, ``sha256``, ``file`` or ``tokens``) is refused;
    a ``file`` naming something outside the folder is refused without reading it.

    Planted bug that fails it: ``_read_manifest`` does not call ``check_signed`` (an entry marked exact that was not
    is then reused as an exact prefix)."""
    tmp = tmp_path_factory.mktemp("sess")
    s = ReuseSession(llama, policy="prefix")
    s.generate(toks(20, 1), **GEN)
    s.save(tmp / "s")
    path = tmp / "s" / "manifest.json"
    manifest = json.loads(path.read_text())
    rec = manifest["entries"][0]
    if field == "file":
        victim = tmp / "victim.safetensors"
        victim.write_bytes((tmp / "s" / rec["file"]).read_bytes())
        rec["file"] = _hostile_name(kind, tmp / "s", victim)
    elif field in ("sha256", "tokens"):
        rec[field] = "0" * 64 if field == "sha256" else rec[field] + 1
    else:
        rec["fields"][field] = (not rec["fields"][field]) if field == "exact" else "0" * 16
    path.write_text(json.dumps(manifest))
    with pytest.raises(PersistedKVError):
        ReuseSession.load(tmp / "s", llama)


# -- 2. two writers of one store entry ------------------------------------------------------------------------------
def test_two_writers_of_one_entry_never_mix_json_and_tensors(tmp_path, monkeypatch):
    """Writer A (exact K/V, ``exact_len=32``) and writer B (other, approximate K/V, ``exact_len=0``) of the same entry
    interleave: B's whole put runs between A's tensor rename and A's JSON. The reader gets one writer's JSON with
    that writer's tensors, never A's JSON over B's tensors.

    Planted bug that fails it: the store's tensor file gets a fixed name (``<id>.safetensors``) and its sha256 is
    taken after the rename (the old rule: A's JSON then vouches for B's tensors)."""
    from hf_kvreuse.vllm.identity import ModelIdentity
    from hf_kvreuse.vllm.store import KVDirStore

    ident = ModelIdentity(weights_sha256="a" * 64, dtype="float32", config_sha256="c" * 64)
    ids = list(range(100, 132))
    ka, va = torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    kb, vb = torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    store = KVDirStore(tmp_path)
    real_replace, fired = os.replace, []

    def interleaving_replace(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(".safetensors") and not fired:
            fired.append(dst)
            KVDirStore(tmp_path).put(ident, ids, kb, vb, exact_len=0, written_by="vllm")

    monkeypatch.setattr(os, "replace", interleaving_replace)
    store.put(ident, ids, ka, va, exact_len=32, written_by="hf")
    monkeypatch.setattr(os, "replace", real_replace)
    assert fired
    reader = KVDirStore(tmp_path)
    (info,) = reader.for_model(ident)
    k, v = reader.load(info, ident)
    if info.exact_len == 32:
        assert torch.equal(k, ka) and torch.equal(v, va)
    else:
        assert torch.equal(k, kb) and torch.equal(v, vb)


# -- 3. damaged files are rewritten on save -------------------------------------------------------------------------
@FAST
@given(pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_save_rewrites_a_damaged_file(llama, tmp_path_factory, pos, bit):
    """Flip any bit of a saved session's K/V file: ``load`` refuses; ``save`` again from the healthy session repairs
    it and ``load`` works. The disk tier's ``put`` repairs a damaged chunk file the same way.

    Planted bug that fails it: ``safe_files.write_atomic`` keeps an existing file of the same name and size (the
    old rule) instead of checking its digest."""
    tmp = tmp_path_factory.mktemp("dmg")
    s = ReuseSession(llama, policy="prefix")
    s.generate(toks(20, 2), **GEN)
    s.save(tmp / "s")
    (data,) = (tmp / "s").glob("kv-*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[pos % len(raw)] ^= 1 << bit
    data.write_bytes(bytes(raw))
    with pytest.raises(PersistedKVError):
        ReuseSession.load(tmp / "s", llama)
    s.save(tmp / "s")
    assert len(ReuseSession.load(tmp / "s", llama)) == 1
    tier = DiskTier(tmp / "t")
    store = ChunkStore(disk=tier)
    ids = toks(16, 4)
    chunk = store.get_or_compute(llama, ids)
    (data,) = tier.folder.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[pos % len(raw)] ^= 1 << bit
    data.write_bytes(bytes(raw))
    with pytest.raises(PersistedKVError):
        DiskTier(tmp / "t").get(llama, store.key(llama, ids))
    tier.put(llama, store.key(llama, ids), chunk)
    assert DiskTier(tmp / "t").get(llama, store.key(llama, ids)) is not None


# -- 4. load keeps the saved cache options --------------------------------------------------------------------------
def test_load_keeps_json_options_and_merges_the_others(llama, tmp_path):
    """A focus session saved with a tokenizer (not JSON) and ``recompute_tokens=40, window=0`` loads, given only the
    tokenizer, with ``recompute_tokens=40`` and ``window=0``; a conflicting value is refused; omitting the
    tokenizer is refused with a message that names it.

    Planted bug that fails it: ``save_session`` records ``method_kwargs=None`` as soon as one value is not JSON
    (the old rule: every option silently back to its default)."""
    from conftest import WordTokenizer

    tok = WordTokenizer()
    s = ReuseSession(llama, policy="focus", method_kwargs=dict(tokenizer=tok, recompute_tokens=40, window=0))
    s.generate(toks(20, 5), **GEN)
    s.save(tmp_path / "s")
    loaded = ReuseSession.load(tmp_path / "s", llama, method_kwargs=dict(tokenizer=tok))
    assert loaded.method_kwargs == dict(tokenizer=tok, recompute_tokens=40, window=0)
    with pytest.raises(ValueError, match="recompute_tokens"):
        ReuseSession.load(tmp_path / "s", llama, method_kwargs=dict(tokenizer=tok, recompute_tokens=8))
    with pytest.raises(ValueError, match="tokenizer"):
        ReuseSession.load(tmp_path / "s", llama)


# -- 8. identity covers the config ----------------------------------------------------------------------------------
def _with_rope_theta(config, theta):
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        config.rope_parameters = dict(rp, rope_theta=theta)
    else:
        config.rope_theta = theta
    return config


def test_same_folder_with_another_rope_theta_is_another_identity(tmp_path):
    """One folder loaded twice, once with another ``rope_theta``: the K/V store keys (transformers side and the
    vLLM side given the engine's config) and the session fingerprint all differ, and an entry written by one is
    refused by the other.

    Planted bug that fails it: ``ModelIdentity.key`` leaves out ``config_sha256`` (the old key: weights and dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_kvreuse.fingerprint import model_fingerprint
    from hf_kvreuse.vllm.identity import ModelMismatchError, folder_identity, hf_model_identity
    from hf_kvreuse.vllm.store import KVDirStore

    tiny_model("llama").save_pretrained(tmp_path / "m")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    cfg = _with_rope_theta(AutoConfig.from_pretrained(tmp_path / "m"), 1234.0)
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "m", config=cfg, dtype=torch.float32).eval()
    ia, ib = hf_model_identity(a, tmp_path / "m"), hf_model_identity(b, tmp_path / "m")
    assert ia.key != ib.key and model_fingerprint(a) != model_fingerprint(b)
    assert folder_identity(tmp_path / "m", torch.float32).key == ia.key
    assert folder_identity(tmp_path / "m", torch.float32, config=cfg).key == ib.key
    store = KVDirStore(tmp_path / "store")
    ids = list(range(5, 21))
    info = store.put(ia, ids, torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8))
    assert store.longest_exact_prefix(ib, ids) == (None, 0)
    with pytest.raises(ModelMismatchError):
        store.load(info, ib)


def test_kv_config_ignores_generation_fields_and_keeps_kv_fields():
    """The identity's config part keeps every field that changes K/V (RoPE, head sizes, windows, multipliers, unknown
    fields) and drops only fields that cannot (token ids, names, generation settings).

    Planted bug that fails it: ``kv_config`` drops ``sliding_window`` (it is not listed as a K/V field)."""
    from hf_kvreuse.fingerprint import config_digest

    base = tiny_model("llama").config
    d0 = config_digest(base)
    for name, value in (("eos_token_id", 77), ("_name_or_path", "elsewhere"), ("use_cache", False)):
        c = base.__class__.from_dict(base.to_dict())
        setattr(c, name, value)
        assert config_digest(c) == d0, name
    for name, value in (("sliding_window", 7), ("head_dim", 4), ("some_new_multiplier", 0.5),
                        ("rms_norm_eps", 1e-3), ("attention_bias", True)):
        c = base.__class__.from_dict(base.to_dict())
        setattr(c, name, value)
        assert config_digest(c) != d0, name


# -- 9. the fingerprint is a real hash of the bytes ----------------------------------------------------------------
@FAST
@given(r=st.integers(0, 6), c=st.integers(0, 1022), d=st.integers(1, 1 << 20))
def test_fingerprint_sees_edits_that_cancel_in_rows_and_columns(r, c, d):
    """Four int32 words of a weight changed by +d, -d, -d, +d at the corners of a rectangle (row and column sums of
    the 1024-word layout unchanged) change the fingerprint.

    Planted bug that fails it: ``tensor_digest`` goes back to row and column sums of int32 words."""
    from hf_kvreuse.fingerprint import model_fingerprint

    m = tiny_model("llama")
    before = model_fingerprint(m)
    p = m.model.embed_tokens.weight
    with torch.no_grad():
        w = p.view(-1).view(torch.int32)  # a write through this view bumps the parameter's version
        assert w.numel() >= 8 * 1024
        for (i, j), s in (((r, c), d), ((r, c + 1), -d), ((r + 1, c), -d), ((r + 1, c + 1), d)):
            w[i * 1024 + j] += s
    assert model_fingerprint(m) != before


def test_fingerprint_is_cached_per_parameter_version(monkeypatch):
    """A second call hashes nothing; an in-place write to one parameter rehashes that parameter only.

    Planted bug that fails it: ``_param_digest`` ignores its cache (every call rehashes every parameter)."""
    from hf_kvreuse import fingerprint

    m = tiny_model("llama")
    fingerprint.model_fingerprint(m)
    calls = []
    real = fingerprint.tensor_digest
    monkeypatch.setattr(fingerprint, "tensor_digest", lambda t: calls.append(t) or real(t))
    fingerprint.model_fingerprint(m)
    assert calls == []
    with torch.no_grad():
        m.model.norm.weight.add_(1)
    fingerprint.model_fingerprint(m)
    assert len(calls) == 1


def test_session_hashes_no_weight_before_its_first_token(monkeypatch, tmp_path):
    """A session holding only its own caches identifies them by a token of the present weights: its calls hash no
    parameter (hashing every weight costs about a second per GB, before the first token it would delay). Saving
    computes the fingerprint, and the saved entries carry it; an in-place write between calls makes the held cache
    another model's: no exact prefix, plain generate's answer.

    Planted bugs that fail it: ``ReuseSession._producer`` always computes the fingerprint (hashes during the
    calls); its token leaves out the parameters' versions (the write goes unseen: the stale cache is reused as an
    exact prefix and the answer differs)."""
    from hf_kvreuse import fingerprint

    m = tiny_model("llama")
    fingerprint.forget(m)
    calls = []
    real = fingerprint.tensor_digest
    monkeypatch.setattr(fingerprint, "tensor_digest", lambda t: calls.append(t) or real(t))
    s = ReuseSession(m, policy="prefix")
    gen = dict(max_new_tokens=4, do_sample=False)
    ids = torch.arange(3, 40)[None]
    out = s.generate(ids, **gen)
    nxt = torch.cat([out, torch.arange(50, 56)[None]], 1)
    s.generate(nxt, attention_mask=torch.ones_like(nxt), **gen)  # an answer may hold the pad id: text here
    assert s.last_stats.exact_prefix_tokens == out.shape[1] - 1
    assert calls == []  # no weight hashed by either call
    s.save(tmp_path / "s")
    assert calls  # the save identifies the entries
    fp = fingerprint.model_fingerprint(m)
    assert {e.producer for e in s._entries.values()} == {fp}
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["model"]["fingerprint"] == fp

    s2 = ReuseSession(m, policy="prefix")
    s2.generate(ids, **gen)
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    kw = dict(attention_mask=torch.ones_like(nxt), return_dict_in_generate=True, output_logits=True, **gen)
    got = s2.generate(nxt, **kw)
    assert s2.last_stats.exact_prefix_tokens == 0
    ref = m.generate(nxt, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-5, rtol=1e-5)
