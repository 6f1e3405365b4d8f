"""K/V that outlive the process (hf_kvreuse.persist): ReuseSession.save / load and the ChunkStore disk tier, on tiny
models; a second process (subprocess) reuses what the first computed; damaged or foreign files are refused."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hf_kvreuse import ChunkStore, DirectReuseCache, DiskTier, PersistedKVError, ReuseSession, enable
from hf_kvreuse.models import tiny_model
from hf_kvreuse.persist import check_kv, kv_layout

from conftest import assert_kv_close

GEN = dict(max_new_tokens=5, do_sample=False)
ROOT = Path(__file__).resolve().parents[1]


def toks(n, seed):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def plain(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **GEN, **kw)


def run_python(code: str, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter with this tree first on the path; return its stdout."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_session_round_trip_is_exact(llama, tmp_path):
    """A session saved and loaded holds the same K/V bit for bit; the loaded session's next call reuses the held
    cache as an exact prefix and gives plain generate's tokens and logits.

    Planted bug that fails it: ``entry_to_record`` writes the layers in reverse order (``enumerate(entry.kv[::-1])``
    in ``_kv_tensors``; every layer has the same shape, so only the K/V comparison and the logits catch it)."""
    s = ReuseSession(llama, policy="prefix")
    out = s.generate(toks(40, 0), agent="a", **GEN)
    s.generate(toks(30, 1), agent="b", **GEN)
    manifest = s.save(tmp_path / "sess")
    assert len(manifest["entries"]) == 2 and (tmp_path / "sess" / "manifest.json").is_file()
    loaded = ReuseSession.load(tmp_path / "sess", llama)
    assert loaded.policy == "prefix" and len(loaded) == 2 and loaded.nbytes == s.nbytes
    for a, b in zip(s._entries.values(), loaded._entries.values()):
        assert torch.equal(a.ids, b.ids) and (a.exact, a.agent, a.producer) == (b.exact, b.agent, b.producer)
        for (k1, v1), (k2, v2) in zip(a.kv, b.kv):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    ids = torch.cat([out, toks(7, 2)], 1)
    got = loaded.generate(ids, agent="a", return_dict_in_generate=True, output_logits=True, **GEN)
    ref = plain(llama, ids, return_dict_in_generate=True, output_logits=True)
    assert loaded.last_stats.exact_prefix_tokens == out.shape[1] - 1
    assert torch.equal(got.sequences, ref.sequences)
    for x, y in zip(got.logits, ref.logits):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_save_again_is_atomic_and_prunes(llama, tmp_path):
    """Saving into a folder that holds a session replaces its manifest; files of the same content are kept, files no
    manifest names go once old enough; the budget of the loading session keeps the most recent caches."""
    s = ReuseSession(llama, policy="prefix")
    s.generate(toks(40, 0), **GEN)
    first = s.save(tmp_path)
    s.generate(toks(50, 3), **GEN)
    second = s.save(tmp_path, prune_after_s=0)
    assert first["entries"][0]["file"] == second["entries"][0]["file"]  # content-addressed: not rewritten
    s.clear()
    s.generate(toks(20, 4), **GEN)
    third = s.save(tmp_path, prune_after_s=0)
    files = sorted(p.name for p in tmp_path.glob("kv-*.safetensors"))
    assert files == [third["entries"][0]["file"]] and not list(tmp_path.glob(".tmp-*"))
    s.generate(toks(45, 5), **GEN)
    s.save(tmp_path)
    newest = list(s._entries.values())[-1].nbytes
    small = ReuseSession.load(tmp_path, llama, max_bytes=newest)
    assert len(small) == 1 and torch.equal(list(small._entries.values())[0].ids, list(s._entries.values())[-1].ids)


def test_load_refuses_foreign_damaged_or_invalid(llama, tmp_path):
    s = ReuseSession(llama, policy="prefix")
    s.generate(toks(30, 0), **GEN)
    s.save(tmp_path)
    other = enable(tiny_model("llama", seed=5))
    with pytest.raises(PersistedKVError, match="another model"):
        ReuseSession.load(tmp_path, other)
    with pytest.raises(PersistedKVError, match="another model"):
        ReuseSession.load(tmp_path, enable(tiny_model("llama").to(torch.bfloat16)))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    f = tmp_path / manifest["entries"][0]["file"]
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(PersistedKVError, match="sha256"):
        ReuseSession.load(tmp_path, llama)
    # a consistent file (its sha256 recorded) whose K/V are not finite: refused all the same
    from safetensors.torch import save_file

    kv = list(s._entries.values())[0].kv
    tensors = {"ids": list(s._entries.values())[0].ids}
    for i, (k, v) in enumerate(kv):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k.clone(), v.clone()
    tensors["v.2"][0, 0, 3, 0] = float("nan")
    save_file(tensors, str(f))
    import hashlib

    from hf_kvreuse.safe_files import sign

    manifest["entries"][0]["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps(sign(manifest)))  # re-signed: only the values are wrong
    with pytest.raises(PersistedKVError, match="non-finite"):
        ReuseSession.load(tmp_path, llama)
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ReuseSession.load(tmp_path / "nothing", llama)


def test_check_kv_shapes_and_dtype(llama):
    layout = kv_layout(llama)
    heads, dim = layout.shapes[0]
    good = [(torch.zeros(1, heads, 3, dim), torch.zeros(1, heads, 3, dim)) for _ in range(layout.layers)]
    check_kv(good, layout, 3, "x")
    with pytest.raises(PersistedKVError, match="layers"):
        check_kv(good[:-1], layout, 3, "x")
    with pytest.raises(PersistedKVError, match="KV heads"):
        check_kv([(torch.zeros(1, heads + 1, 3, dim), v) for _, v in good], layout, 3, "x")
    with pytest.raises(PersistedKVError, match="head dim"):
        check_kv([(k, torch.zeros(1, heads, 3, dim * 2)) for k, _ in good], layout, 3, "x")
    with pytest.raises(PersistedKVError, match="4 tokens"):
        check_kv(good, layout, 4, "x")
    with pytest.raises(PersistedKVError, match="dtype"):
        check_kv([(k.half(), v.half()) for k, v in good], layout, 3, "x")


def test_disk_tier_is_exact_and_has_its_own_budget(llama, tmp_path):
    """Chunks written by one store and read by a new one (a restarted process) are the chunks computed, and a block
    cache assembled from the disk tier equals one assembled from memory (K/V and tokens). Each tier keeps its own
    byte budget.

    Planted bug that fails it: ``DiskTier.get`` returns the chunk with ``start=0`` instead of the recorded start
    (a chunk computed under a prefix is then re-positioned from the wrong positions)."""
    ids = toks(48, 7)
    spans, prefix = [(8, 24), (28, 44)], toks(5, 8)
    mem = ChunkStore()
    ref = DirectReuseCache(llama, ids, spans, store=mem, block_prefix_ids=prefix)
    ref_out = llama.generate(ids, cache=ref, **GEN)
    writer = ChunkStore(disk=DiskTier(tmp_path / "tier"))
    llama.generate(ids, cache=DirectReuseCache(llama, ids, spans, store=writer, block_prefix_ids=prefix), **GEN)
    assert writer.disk.writes == 2 and len(writer.disk) == 2
    restarted = ChunkStore(disk=DiskTier(tmp_path / "tier"))
    cache = DirectReuseCache(llama, ids, spans, store=restarted, block_prefix_ids=prefix)
    out = llama.generate(ids, cache=cache, **GEN)
    assert cache.stats.store_hits == 2 and cache.stats.store_misses == 0 and restarted.disk.hits == 2
    assert torch.equal(out, ref_out)
    assert_kv_close(cache, ref, atol=0, rtol=0)
    one = restarted._items[next(iter(restarted._items))].nbytes
    tight = ChunkStore(max_bytes=one, disk=DiskTier(tmp_path / "tight", max_bytes=int(one * 1.5)))
    for i in range(3):
        tight.get_or_compute(llama, toks(16, 20 + i))
    assert len(tight) == 1 and tight.evictions == 2 and len(tight.disk) == 1 and tight.disk.evictions == 2
    assert tight.disk.nbytes <= tight.disk.max_bytes


def test_disk_tier_refuses_damaged_or_foreign(llama, tmp_path):
    tier = DiskTier(tmp_path)
    store = ChunkStore(disk=tier)
    chunk_ids = toks(16, 9)
    store.get_or_compute(llama, chunk_ids)
    other = enable(tiny_model("llama", seed=6))
    assert ChunkStore(disk=DiskTier(tmp_path)).get(other, chunk_ids) is None  # another model's key: a miss
    (data,) = tier.folder.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(PersistedKVError, match="sha256"):
        ChunkStore(disk=DiskTier(tmp_path)).get(llama, chunk_ids)


def test_second_process_reuses_what_the_first_computed(llama, tmp_path):
    """Process 1 (a subprocess) runs a session and writes chunks to a disk tier; this process loads the session and
    opens the tier: its call reuses process 1's cache as an exact prefix (plain generate's tokens and logits), and
    the chunks are hits equal to what this process computes."""
    out_file = tmp_path / "out.json"
    run_python(f"""
        import json, torch
        from hf_kvreuse import ReuseSession, ChunkStore, DiskTier, enable
        from hf_kvreuse.models import tiny_model
        m = enable(tiny_model("llama"))
        ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        s = ReuseSession(m, policy="prefix")
        out = s.generate(ids, max_new_tokens=5, do_sample=False)
        s.save({str(tmp_path / 'sess')!r})
        store = ChunkStore(disk=DiskTier({str(tmp_path / 'tier')!r}))
        store.get_or_compute(m, ids[0, :16])
        json.dump(out.tolist(), open({str(out_file)!r}, "w"))
    """)
    out = torch.tensor(json.loads(out_file.read_text()))
    s = ReuseSession.load(tmp_path / "sess", llama)
    ids = torch.cat([out, toks(6, 11)], 1)
    got = s.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
    ref = plain(llama, ids, return_dict_in_generate=True, output_logits=True)
    assert s.last_stats.exact_prefix_tokens == out.shape[1] - 1 and torch.equal(got.sequences, ref.sequences)
    for x, y in zip(got.logits, ref.logits):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    store = ChunkStore(disk=DiskTier(tmp_path / "tier"))
    chunk = store.get(llama, out[0, :16])
    assert chunk is not None and store.disk.hits == 1
    fresh = ChunkStore().get_or_compute(llama, out[0, :16])
    for (k1, v1), (k2, v2) in zip(chunk.kv, fresh.kv):
        torch.testing.assert_close(k1, k2, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v1, v2, atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # three processes, ~1 min on 2 busy cores: the full leg only
def test_reader_while_other_processes_write(llama, tmp_path):
    """Two subprocesses keep saving a session into one folder and writing the same chunks into one disk tier (with
    evictions) while this process keeps loading the session and reading the chunks: every load succeeds and every
    chunk found is the one computed (atomic renames; a chunk evicted meanwhile is a miss, never a partial file);
    afterwards every chunk the tier names is there and verifies, and the tier is filled to its budget (evictions
    stop as soon as it fits).

    Planted bug: ``DiskTier._enforce_budget`` does not subtract the evicted bytes (so it evicts every chunk once the
    budget is exceeded): fails, fewer chunks held than fit (2 or 0 where 3 fit)."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import torch
        from hf_kvreuse import ReuseSession, ChunkStore, DiskTier, enable
        from hf_kvreuse.models import tiny_model
        m = enable(tiny_model("llama"))
        s = ReuseSession(m, policy="prefix", max_bytes=200_000)
        store = ChunkStore(disk=DiskTier({str(tmp_path / 'tier')!r}, max_bytes=60_000))
        g = torch.Generator().manual_seed(int(sys.argv[1]))
        for i in range(6):
            s.generate(torch.randint(3, 128, (1, 30 + 3 * i), generator=g), max_new_tokens=2, do_sample=False)
            s.save({str(tmp_path / 'sess')!r}, prune_after_s=0.5)
            store.get_or_compute(m, torch.arange(3, 19) + i)
        print("done")
    """))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(w)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in range(2)]
    fresh = {i: ChunkStore().get_or_compute(llama, torch.arange(3, 19) + i) for i in range(6)}
    loads = hits = 0
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.05)
            if (tmp_path / "sess" / "manifest.json").exists():
                s = ReuseSession.load(tmp_path / "sess", llama)
                loads += 1
                assert len(s) >= 1
            if (tmp_path / "tier").exists():
                reader = ChunkStore(disk=DiskTier(tmp_path / "tier"))
                for i, ref in fresh.items():
                    chunk = reader.get(llama, torch.arange(3, 19) + i)
                    if chunk is not None:
                        hits += 1
                        torch.testing.assert_close(chunk.kv[0][0], ref.kv[0][0], atol=1e-6, rtol=1e-6)
    finally:
        errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    assert loads >= 1 and hits >= 1
    final = ReuseSession.load(tmp_path / "sess", llama)
    assert final.nbytes <= 200_000
    tier = DiskTier(tmp_path / "tier", max_bytes=60_000)
    one = DiskTier(tmp_path / "one")  # every chunk has 16 tokens: the tier holds as many as fit, no fewer
    ChunkStore(disk=one).get_or_compute(llama, torch.arange(3, 19))
    assert (len(tier), tier.nbytes <= 60_000) == (60_000 // one.nbytes, True)
    reader = ChunkStore(disk=tier)
    assert sum(reader.get(llama, torch.arange(3, 19) + i) is not None for i in fresh) == len(tier)


@pytest.mark.parametrize("history", [True, False], ids=["history", "windows"])
def test_sliding_window_session_round_trip(tmp_path, history):
    """A session on a sliding-window model (qwen2: 2 full + 2 sliding layers, window 8) saves and loads: the loaded
    entries equal the saved ones row for row (with ``sliding_history``: every row of every layer; without: the
    sliding layers' last 7 rows plus their copy at the prompt's end), and the next call reuses them as an exact
    prefix with plain generate's tokens and logits.

    Planted bug that fails it: ``entry_from_record`` checks every layer for one row per token (the check before
    sliding-window sessions): [windows] raises PersistedKVError "layer 2 K has shape (1, 2, 7, 16)". Another:
    ``entry_to_record`` skips the ``marks`` field (the prompt boundary is lost): [windows] fails the boundary
    assertion. Another: ``entry_from_record`` accepts only window rows for sliding layers: [history] raises."""
    from test_reliability import SLIDING, _sliding_model

    assert "qwen2" in SLIDING
    m = _sliding_model("qwen2")
    s = ReuseSession(m, policy="prefix", sliding_history=history)
    out = s.generate(toks(20, 0), **GEN)
    s.save(tmp_path / "sess")
    loaded = ReuseSession.load(tmp_path / "sess", m)
    assert loaded.sliding_history is history
    (a,), (b,) = list(s._entries.values()), list(loaded._entries.values())
    assert torch.equal(a.ids, b.ids) and [k.shape[-2] for k, _ in b.kv] == [k.shape[-2] for k, _ in a.kv]
    rows = sorted({k.shape[-2] for k, _ in b.kv})
    assert rows == ([a.ids.numel()] if history else [7, a.ids.numel()])
    for (k1, v1), (k2, v2) in zip(a.kv, b.kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # the prompt boundary (sliding layers' rows at the end of the prompt) comes back too, row for row
    assert list(a.marks) == list(b.marks) == ([] if history else [20])
    for r1, r2 in zip(a.marks.get(20, []), b.marks.get(20, [])):
        assert (r1 is None) == (r2 is None)
        if r1 is not None:
            assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    ids = torch.cat([out, toks(4, 5)], 1)
    got = loaded.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
    ref = plain(m, ids, return_dict_in_generate=True, output_logits=True)
    assert loaded.last_stats.exact_prefix_tokens == out.shape[1] - 1 and torch.equal(got.sequences, ref.sequences)
    for x, y in zip(got.logits, ref.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
