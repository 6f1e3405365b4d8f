"""The default path: exact, never raising where it can step down, saying what it did and why; stateful logits
processors; one exactness vocabulary. Every test names in its docstring a planted bug that makes it fail
(docs/MUTATIONS.md, "Honest defaults")."""

import pytest
import torch

from hf_kvreuse import OptimisticCache, ReuseSession, output_cache
from hf_kvreuse.auto import AutoChooser
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.generation.options import stateful_steps
from hf_kvreuse.models.arch_zoo import zoo_model

from conftest import agent_prompts

GEN = dict(max_new_tokens=6, do_sample=False)


def _plain(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{**GEN, **kw})


def _force_drafts(monkeypatch):
    """The session's chooser always asks for verified drafts (the path a measured win takes)."""
    monkeypatch.setattr(AutoChooser, "choose", lambda self, device, n, new: (True, "forced by the test"))


@pytest.mark.parametrize("arch", ["gpt2", "llama@dynamic"])
def test_auto_steps_down_where_drafts_cannot_run(arch, monkeypatch):
    """``ReuseSession()`` (policy "auto") on a model whose K/V cannot be re-positioned (GPT-2's absolute
    positions, ``rope_type="dynamic"``) reuses exact prefixes instead of raising, says so in ``last_stats``
    (``method``, ``reason``), and answers as plain generate does; ``policy="optimistic"`` asked for by name still
    refuses with a clear error.

    Planted bug that fails it: ``_auto`` skips the model check and the step-down catches no constructor error
    (``except ()``): the OptimisticCache constructor then raises inside the default path. (Either alone is covered
    by the other.)"""
    _force_drafts(monkeypatch)
    model = zoo_model(arch)
    a, b = agent_prompts(shared=40)
    session = ReuseSession(model, min_donor_tokens=4)
    session.generate(a, **GEN)
    out = session.generate(b, **GEN)
    st = session.last_stats
    assert st.method in ("prefix", "full") and st.reason and "re-position" in st.reason, st
    assert st.exact_output and torch.equal(out, _plain(model, b))
    with pytest.raises(ValueError, match="re-position|position"):
        session.generate(b, policy="optimistic", **GEN)


def test_auto_prefers_exact_prefix_until_drafts_measure_faster(llama, monkeypatch):
    """Before anything is measured "auto" runs exact prefix reuse (reason given, ``exact_output``); with measured
    verified-draft ratios <= 1 it drafts, with ratios > 1 it does not; it never tries drafts where a short exact
    prefix could make them slower than plain generate.

    Planted bug that fails it: ``AutoChooser.choose`` compares the median ratios with ``>= 1``."""
    a, b = agent_prompts(shared=40)
    session = ReuseSession(llama, min_donor_tokens=4)
    session.generate(a, **GEN)
    out = session.generate(b, **GEN)
    st = session.last_stats
    assert st.method in ("prefix", "full") and st.exact_output and "exact prefix" in st.reason
    assert torch.equal(out, _plain(llama, b))
    ch = AutoChooser(prior=2.0, explore_calls=1)
    dev = torch.device("cpu")
    assert ch.choose(dev, 100, 10) == (False, ch.choose(dev, 100, 10)[1])  # nothing measured
    ch.record_exact(dev, 100, 1.0, 2.0, 11)
    assert ch.choose(dev, 100, 10)[0] and not ch.choose(dev, 100, 60)[0]  # try only with a long exact prefix
    ch.record_drafts(dev, 10, 0.05, 0.5, 11)  # predicted 0.1 / 1.1: measured faster
    assert ch.choose(dev, 100, 10)[0]
    slow = AutoChooser(explore_calls=1)
    slow.record_exact(dev, 100, 1.0, 2.0, 11)
    slow.record_drafts(dev, 10, 0.3, 2.0, 11)
    drafts, why = slow.choose(dev, 100, 10)
    assert not drafts and "3.00x" in why


def test_auto_runs_plain_prefill_behind_a_prefix_too_short_to_pay(llama):
    """A held exact prefix of a few tokens (a chat template's header) does not pay for the explicit-mask prefill
    behind it (measured 3-10% later first token on a 2-core CPU): "auto" runs plain prefill there and says why,
    reuses a prefix covering enough of the prompt, and once both kinds of exact call are measured the measured
    per-token costs decide. Answers equal plain generate's either way.

    Planted bug that fails it: ``AutoChooser.prefix_pays`` always returns True (every held prefix is reused, the
    6-token header included, as before this check)."""
    g = torch.Generator().manual_seed(3)
    head = torch.randint(3, 100, (1, 3), generator=g)
    doc = torch.randint(3, 100, (1, 60), generator=g)
    session = ReuseSession(llama)
    session.generate(torch.cat([head, doc], 1), **GEN)
    other = torch.cat([head, torch.randint(3, 100, (1, 60), generator=g)], 1)  # shares the 3-token header only
    out = session.generate(other, **GEN)
    st = session.last_stats
    assert st.method == "full" and "plain prefill" in st.reason and st.exact_output, st
    assert torch.equal(out, _plain(llama, other))
    longer = torch.cat([head, doc, torch.randint(3, 100, (1, 8), generator=g)], 1)  # extends the first prompt
    out = session.generate(longer, **GEN)
    assert session.last_stats.method == "prefix" and torch.equal(out, _plain(llama, longer))
    ch, dev = AutoChooser(), torch.device("cpu")
    assert not ch.prefix_pays(dev, 100, 5)[0] and ch.prefix_pays(dev, 100, 20)[0]  # unmeasured: the share
    ch.record_exact(dev, 100, 1.0, 1.0, 1)            # plain: 10 ms per token
    ch.record_exact(dev, 50, 0.6, 0.6, 1, past=50)     # behind a prefix: 12 ms per token
    assert not ch.prefix_pays(dev, 100, 15)[0]         # 85 x 12 ms > 100 x 10 ms
    assert ch.prefix_pays(dev, 100, 20)[0]             # 80 x 12 ms < 100 x 10 ms


def test_guidance_scale_runs_once_per_token(llama, monkeypatch):
    """Classifier-free guidance (``guidance_scale``, a processor with its own model calls and cache): the default
    session answers as plain generate does (it steps down to exact prefix reuse and says why, even where drafts
    would be chosen), and an OptimisticCache with verified drafts refuses the call with an error naming the
    processor instead of answering differently.

    Planted bug that fails it: ``stateful_steps`` treats every processor as stateless (the session then drafts
    and verifies with a CFG processor run twice per token, and the answer differs from plain generate's)."""
    _force_drafts(monkeypatch)
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    a, b = agent_prompts(shared=40)
    ref = _plain(llama, b, guidance_scale=3.0, max_new_tokens=8)
    session = ReuseSession(llama, min_donor_tokens=4)
    session.generate(a, **GEN)
    out = session.generate(b, **{**GEN, "guidance_scale": 3.0, "max_new_tokens": 8})
    assert torch.equal(out, ref) and "guidance_scale" in session.last_stats.reason
    donor = llama.generate(a, return_dict_in_generate=True, **GEN)
    cache = OptimisticCache(llama, b, output_cache(donor), donor.sequences, max_optimistic_tokens=3)
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        llama.generate(b, cache=cache, guidance_scale=3.0, **GEN)
    # a processor of the caller's own is unknown unless it declares itself stateless
    class Scale:
        def __call__(self, input_ids, scores):
            return scores * 2

    assert stateful_steps([Scale()]) == ["Scale"]
    Scale.hf_kvreuse_stateless = True
    assert stateful_steps([Scale()]) == []


def test_a_refused_call_leaves_the_donor_as_it_was(llama):
    """A call an OptimisticCache refuses (a stateful processor) leaves the caller's donor cache as it was (every
    layer's K/V equal), the refused cache says to build a new one instead of serving stale state, and a new cache
    over the same donor answers as plain generate does. Planted bug that fails it: ``finish`` releases the donors'
    rows whatever ``release_donor`` says (the donor is empty after the refusal)."""
    from hf_kvreuse.kv import kv_of

    a, b = agent_prompts(shared=40)
    donor = llama.generate(a, return_dict_in_generate=True, **GEN)
    before = [(k.clone(), v.clone()) for k, v in kv_of(output_cache(donor))]
    cache = OptimisticCache(llama, b, output_cache(donor), donor.sequences, max_optimistic_tokens=3)
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        llama.generate(b, cache=cache, guidance_scale=3.0, **GEN)
    after = list(kv_of(output_cache(donor)))
    assert len(after) == len(before) and all(torch.equal(k0, k1) and torch.equal(v0, v1)
                                             for (k0, v0), (k1, v1) in zip(before, after))
    with pytest.raises(RuntimeError, match="build a new cache"):
        llama.generate(b, cache=cache, **GEN)
    fresh = OptimisticCache(llama, b, output_cache(donor), donor.sequences, max_optimistic_tokens=3)
    out = llama.generate(b, cache=fresh, **GEN)
    assert torch.equal(out, _plain(llama, b)) and fresh.stats.reused_tokens > 0


def test_one_exactness_vocabulary(llama, monkeypatch):
    """``exact_output`` says whether the answer is plain generate's: True under verified drafts (with drafted /
    accepted counts, ``ttft_s`` the first verified token, after ``draft_ttft_s``), False for commit tokens emitted
    from the optimistic cache, in the cache's stats and the session's.

    Planted bug that fails it: ``finish`` sets ``exact_output`` from the cache's exactness (``stats.exact``), which
    is True after every swap, commit included."""
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    a, b = agent_prompts(shared=40)
    donor = llama.generate(a, return_dict_in_generate=True, **GEN)
    verify = OptimisticCache(llama, b, output_cache(donor), donor.sequences, max_optimistic_tokens=3)
    assert verify.rebase == "verify"  # the default
    llama.generate(b, cache=verify, **GEN)
    st = verify.stats
    assert st.exact_output and st.drafted_tokens == 3 and st.accepted_tokens + st.rejected_tokens == 3
    assert st.ttft_s >= st.draft_ttft_s
    commit = OptimisticCache(llama, b, output_cache(donor), donor.sequences, max_optimistic_tokens=3,
                             rebase="commit")
    llama.generate(b, cache=commit, **GEN)
    assert commit.stats.exact and not commit.stats.exact_output and commit.stats.ttft_s == commit.stats.draft_ttft_s
    session = ReuseSession(llama, min_donor_tokens=4, rebase="commit")
    session.generate(a, **GEN)
    session.generate(b, **GEN)
    st = session.last_stats
    assert st.method == "optimistic" and not st.exact_output and "commit" in st.reason


@pytest.mark.slow  # SmolLM2 through the pipeline
def test_pipeline_keys_follow_one_rule(smollm2):
    """``question=`` -> ``"answer"`` and ``questions=`` -> ``"answers"``, with agents too (per agent inside); the
    context mode refuses ``batch_size > 1`` (given to the call or to ``pipeline(...)``) instead of running one by
    one silently; a chat gets the stock ``[{"generated_text": ...}]`` with its stats under ``"stats"``.

    Planted bug that fails it: ``ask`` returns ``"answers"`` for ``question=`` with agents (the old key)."""
    from transformers import pipeline

    model, tok = smollm2
    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    gen = dict(max_new_tokens=2, do_sample=False)
    out = pipe("The Nile flows north.", question="Where?", agents={"a": "You are terse.", "b": "You are kind."},
               **gen)
    assert set(out) == {"answer", "stats"} and set(out["answer"]) == {"a", "b"}
    assert all(s.exact_output for s in out["stats"].values())
    out = pipe("The Nile flows north.", questions=["Where?"], agents=["You are terse."], **gen)
    assert set(out) == {"answers", "stats"} and len(out["answers"][0]) == 1
    with pytest.raises(ValueError, match="batch_size=2"):
        pipe("The Nile flows north.", question="Where?", batch_size=2, **gen)
    batched = pipeline("kvreuse-text-generation", model=model, tokenizer=tok, batch_size=2)
    with pytest.raises(ValueError, match="batch_size=2"):
        batched("The Nile flows north.", question="Where?", **gen)
    (rec,) = pipe([{"role": "user", "content": "Hi"}], method="auto", **gen)
    assert set(rec) == {"generated_text", "stats"} and rec["stats"].exact_output


def test_cli_help_defines_every_column_and_prints_defaults_as_values(capsys):
    """``hf-kvreuse bench --help`` defines every column the summary table prints, and no default is printed as
    ``None`` or as a Python list.

    Planted bug that fails it: a column (``draftx``) is printed by ``print_summary`` but missing from ``COLUMNS``."""
    from hf_kvreuse.cli import COLUMNS, build_parser, print_summary

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # the help wraps lines
    assert "default: None" not in text and "['" not in text and "default: fully_connected" in text
    row = dict(workflow="w", context_tokens=1, method="auto", n=1, accuracy=1.0, agreement=1.0, ttft_s=0.1,
               ttft_ratio=1.0, e2e_ratio=1.0, exact_output_share=1.0, draft_ttft_ratio=0.5)
    print_summary([row])
    header = capsys.readouterr().out.splitlines()[0]
    for name in COLUMNS:
        assert name in text, name
        header = header.replace(name, "")
    assert not header.strip(), f"undefined columns: {header.split()}"
