"""OptimisticCache with verified drafts (``rebase="verify"``), the confidence gate and the repair of the optimistic
cache (issue 23). Every test names in its docstring a planted bug that makes it fail (docs/MUTATIONS.md)."""

import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvreuse import OptimisticCache, ReuseSession, enable, output_cache
from hf_kvreuse.cache_classes.optimistic import sample_accept
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import tiny_model

from conftest import assert_kv_close, exact_prefill


def _agents(seed=0, shared=40, vocab=128):
    g = torch.Generator().manual_seed(seed)
    ids_a = torch.randint(3, vocab, (1, shared), generator=g)
    ids_b = torch.cat([torch.randint(3, vocab, (1, 5), generator=g), ids_a[:, 4:]], 1)
    return ids_a, ids_b


def _donor(model, ids):
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    return output_cache(out), out.sequences


def _full(model, ids, **kw):
    return model.generate(ids, return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)


def _same_as(out, ref, atol=1e-4):
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    torch.testing.assert_close(torch.cat(out.scores), torch.cat(ref.scores), atol=atol, rtol=atol)
    torch.testing.assert_close(torch.cat(out.logits), torch.cat(ref.logits), atol=atol, rtol=atol)


@pytest.fixture
def held(monkeypatch):
    """The background exact prefill is never ready on its own: the swap happens at max_optimistic_tokens."""
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)


@pytest.mark.parametrize("donor", ["other_agent", "same_prompt"])
@pytest.mark.parametrize("swap_after", [0, 1, 4, "all"])
def test_verify_greedy_is_plain_generate(arch_model, monkeypatch, donor, swap_after):
    """Greedy ``rebase="verify"`` gives plain generate's tokens, processed scores and raw logits, with the swap
    after 0, 1, several and all tokens, with drafts that are all withdrawn (another agent's re-positioned cache on
    a random model) or all kept (the prompt's own cache); the returned cache is the exact cache of the output.

    Planted bugs that fail it: ``_verify`` keeps one draft too many (``j + 1``); it replays the drafts one position
    too far (``arange(n, n + g + 1)``). (Cropping one row too many is an equivalent mutant: generate then feeds
    the missing row again.)"""
    model = arch_model
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(model, ids_a if donor == "other_agent" else ids_b)
    new = 10
    if swap_after == 0:
        monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: True)
        limit = 8
    else:
        monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
        limit = None if swap_after == "all" else swap_after
    cache = OptimisticCache(model, ids_b, cache_a, seq_a, max_optimistic_tokens=limit, rebase="verify")
    out = _full(model, ids_b, cache=cache, max_new_tokens=new, do_sample=False)
    ref = _full(model, ids_b, max_new_tokens=new, do_sample=False)
    _same_as(out, ref)
    st = cache.stats
    drafts = {0: 0, 1: 1, 4: 4, "all": new}[swap_after]
    assert st.optimistic_tokens == drafts and st.accepted_tokens + st.rejected_tokens == drafts
    if donor == "same_prompt":
        assert st.rejected_tokens == 0  # the prompt's own cache is exact: every draft is kept
    assert st.ttft_s is not None and st.ttft_s >= st.draft_ttft_s and st.exact and st.exact_output
    exact, _ = exact_prefill(model, out.sequences[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)
    # the returned cache continues the conversation as plain generate would
    more = torch.cat([out.sequences, torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(9))], 1)
    assert torch.equal(model.generate(more, cache=cache, max_new_tokens=4, do_sample=False),
                       model.generate(more, max_new_tokens=4, do_sample=False))


def test_planted_rejection_in_the_middle(llama, held, monkeypatch):
    """Drafts from an exact cache with one planted wrong draft (the 4th): the first 3 are kept, the 4th is replaced
    by the exact choice, the rest withdrawn, and the output is plain generate's.

    Planted bug that fails it: ``_verify`` counts kept drafts with ``sum`` instead of the cumulative product (a
    draft after the rejection counts as kept: a wrong token stays)."""
    ids = _agents()[1]
    cache_a, seq_a = _donor(llama, ids)
    ref = _full(llama, ids, max_new_tokens=10, do_sample=False)
    wrong = int((ref.sequences[0, ids.shape[1] + 3] + 1) % 128)
    after = OptimisticCache.after_forward

    def plant(self, outputs):
        if not self._swapped and self._forwards == 3:  # the forward that scores the 4th token
            outputs.logits[0, -1, wrong] = 1e4
        return after(self, outputs)

    monkeypatch.setattr(OptimisticCache, "after_forward", plant)
    cache = OptimisticCache(llama, ids, cache_a, seq_a, max_optimistic_tokens=8, rebase="verify")
    out = _full(llama, ids, cache=cache, max_new_tokens=10, do_sample=False)
    _same_as(out, ref)
    assert (cache.stats.accepted_tokens, cache.stats.rejected_tokens) == (3, 5)
    assert cache.stats.first_divergence == 3


@pytest.mark.parametrize("rule", ["eos_in_withdrawn_draft", "eos_after_rollback", "max_length", "max_new_tokens",
                                  "min_new_tokens"])
def test_stopping_rules_hold_after_a_rollback(llama, held, rule):
    """Every stopping rule holds after a rollback: an EOS among withdrawn drafts does not end the output, an EOS
    chosen by the exact model does, ``max_length`` / ``max_new_tokens`` count from the original prompt, and
    ``min_new_tokens`` keeps EOS out until that many tokens after the original prompt.

    Planted bugs that fail it: the continuing generate builds its own logits processors and stopping criteria
    (``continuing_parts`` returns None: [min_new_tokens] fails); that, and the continuation given the caller's
    ``max_new_tokens`` instead of what is left ([max_new_tokens] fails: too many tokens)."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    n = ids_b.shape[1]
    plain = llama.generate(ids_b, max_new_tokens=12, do_sample=False)
    kw = dict(max_new_tokens=12)
    if rule.startswith("eos"):
        probe = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
        drafted = llama.generate(ids_b, cache=probe, max_new_tokens=6, do_sample=False)[0, n:]
        if rule == "eos_in_withdrawn_draft":  # a draft that the exact model does not choose
            eos = next(int(t) for t, p in zip(drafted, plain[0, n:]) if t != p and int(t) not in plain[0, n:])
        else:  # a token the exact model chooses after the drafts (the first of its kind in the answer)
            gen = plain[0, n:].tolist()
            stop_at = next(i for i in range(6, 12) if gen[i] not in gen[:i])
            eos = gen[stop_at]
        kw["eos_token_id"] = eos
        plain = llama.generate(ids_b, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
        kw["pad_token_id"] = 0
    elif rule == "max_length":
        kw = dict(max_length=n + 9)
        plain = llama.generate(ids_b, do_sample=False, **kw)
    elif rule == "min_new_tokens":  # EOS = a token the exact model chooses at step k >= 6, forbidden until k + 2
        gen = plain[0, n:].tolist()
        k = next(i for i in range(6, 12) if gen[i] not in gen[:i])
        kw = dict(max_new_tokens=12, min_new_tokens=k + 2, eos_token_id=gen[k], pad_token_id=0)
        plain = llama.generate(ids_b, do_sample=False, **kw)
        assert plain.shape[1] > n + k + 1  # EOS was kept out at step k
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="verify")
    out = llama.generate(ids_b, cache=cache, do_sample=False, **kw)
    assert torch.equal(out, plain), (rule, out[0, n:], plain[0, n:])
    if rule == "eos_after_rollback":
        assert out.shape[1] == n + stop_at + 1


def _char_tokenizer(vocab_size: int):
    """A tokenizer whose token ``i`` is one character (letters first: transformers' stop-string matcher encodes
    "abcdef"), with no merges: stop strings need a tokenizer."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    chars += "".join(chr(0x4E00 + i) for i in range(max(0, vocab_size - len(chars))))
    backend = Tokenizer(BPE({c: i for i, c in enumerate(chars[:vocab_size])}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("where", ["in_withdrawn_draft", "at_the_verified_token", "after_rollback"])
def test_stop_strings_hold_after_a_rollback(llama, held, where):
    """``stop_strings=``: a stop string that only a withdrawn draft spells does not end the output; one the exact
    model writes in place of the first withdrawn draft, or later, does, at the same token as plain generate.

    Planted bug that fails it: ``_verify`` reports the generation as not done after the exact model's token
    (``return ..., False``): [at_the_verified_token] fails (the continuation does not look back at the stop string
    already written). (The continuing generate building its own stopping criteria is an equivalent mutant here: a
    fresh stop-string criterion reads the same sequence.)"""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    n = ids_b.shape[1]
    tok = _char_tokenizer(llama.config.vocab_size)
    plain = llama.generate(ids_b, max_new_tokens=12, do_sample=False)[0, n:].tolist()
    probe = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
    drafted = llama.generate(ids_b, cache=probe, max_new_tokens=6, do_sample=False)[0, n:].tolist()
    if where == "in_withdrawn_draft":
        stop = next(t for t, p in zip(drafted, plain) if t != p and t not in plain)
    elif where == "at_the_verified_token":
        j = next(i for i, (t, p) in enumerate(zip(drafted, plain)) if t != p)
        stop = plain[j]
        assert stop not in plain[:j] and stop not in drafted  # the seed gives such a token: no earlier stop
    else:
        stop = plain[next(i for i in range(6, 12) if plain[i] not in plain[:i])]
    kw = dict(max_new_tokens=12, do_sample=False, stop_strings=[tok.convert_ids_to_tokens(stop)], tokenizer=tok,
              pad_token_id=0)
    ref = llama.generate(ids_b, **kw)
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="verify")
    out = llama.generate(ids_b, cache=cache, **kw)
    assert torch.equal(out, ref), (where, out[0, n:], ref[0, n:])
    assert cache.stats.rejected_tokens > 0
    if where == "in_withdrawn_draft":
        assert out.shape[1] == n + 12 and stop in drafted
    elif where == "at_the_verified_token":
        assert out.shape[1] == n + j + 1 and int(out[0, -1]) == stop
    else:
        assert out.shape[1] < n + 12 and int(out[0, -1]) == stop


def test_streamer_receives_verified_tokens_only(llama, held):
    """The caller's streamer gets the prompt, then exactly the output's tokens (never a withdrawn draft), then
    ``end()`` once.

    Planted bug that fails it: ``drive`` passes the caller's streamer to the drafting generate unwrapped (the
    withdrawn drafts are streamed)."""
    class Recorder:
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ends += 1

    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    rec = Recorder()
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=5, rebase="verify")
    out = llama.generate(ids_b, cache=cache, max_new_tokens=10, do_sample=False, streamer=rec)
    assert cache.stats.rejected_tokens > 0
    assert rec.puts[0] == ids_b[0].tolist() and rec.ends == 1
    assert sum(rec.puts[1:], []) == out[0, ids_b.shape[1]:].tolist()


def test_sample_accept_draws_as_plain_sampling_does():
    """``sample_accept`` keeps a draft only while it equals a draw from the exact scores with the global generator,
    and leaves the generator where ``kept + 1`` (``kept`` when all are kept) plain sampling draws leave it, over many
    random cases (drafts that match the draws partly, wholly or not at all).

    Planted bug that fails it: the generator is not rewound after the look-ahead draws (the next draw of the
    continuation then differs from plain sampling's)."""
    for case in range(100):
        g = torch.Generator().manual_seed(case)
        v, k = 12, int(torch.randint(1, 5, (), generator=g))
        scores = torch.randn(k + 1, v, generator=g) * 2
        torch.manual_seed(1000 + case)
        draws = [int(torch.multinomial(torch.softmax(scores[i: i + 1], -1), 1)) for i in range(k)]
        after = [int(torch.multinomial(torch.softmax(scores[i: i + 1], -1), 1)) for i in range(k)]
        cut = case % (k + 1)  # drafts equal to the draws up to ``cut``, then one different token
        drafts = torch.tensor(draws[:cut] + [(d + 1) % v for d in draws[cut:]])
        torch.manual_seed(1000 + case)
        j, nxt = sample_accept(scores, drafts)
        assert j == cut
        if j < k:
            assert int(nxt) == draws[j]
            # the generator is where plain sampling's is after j + 1 draws
            rest = int(torch.multinomial(torch.softmax(scores[j + 1: j + 2] if j + 1 <= k else scores[-1:], -1), 1))
            torch.manual_seed(1000 + case)
            for i in range(j + 1):
                torch.multinomial(torch.softmax(scores[i: i + 1], -1), 1)
            assert rest == int(torch.multinomial(torch.softmax(scores[j + 1: j + 2] if j + 1 <= k else
                                                               scores[-1:], -1), 1))
        del after


@pytest.mark.parametrize("swap_after", [1, 3, 6, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_is_plain_generate(llama, monkeypatch, swap_after, seed):
    """Sampling with ``rebase="verify"`` and a seed gives plain generate's tokens with the same seed, token for
    token, whatever the swap step (forced after 1, 3, 6 drafts, or at the end), with drafts from another agent's
    re-positioned cache (some kept, some withdrawn).

    Planted bug that fails it: ``drive`` does not put the generator back to its state before the drafts (the
    verified draws then depend on how many drafts were sampled)."""
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.5, top_k=0)
    torch.manual_seed(seed)
    ref = _full(llama, ids_b, **kw)
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=swap_after)
    torch.manual_seed(seed)
    out = _full(llama, ids_b, cache=cache, **kw)
    assert torch.equal(out.sequences, ref.sequences), (swap_after, cache.stats)
    torch.testing.assert_close(torch.cat(out.logits), torch.cat(ref.logits), atol=1e-4, rtol=1e-4)
    assert cache.stats.exact_output and cache.stats.drafted_tokens == (swap_after or 12)
    # the generator is left where plain generate leaves it
    assert torch.equal(torch.rand(3), (torch.manual_seed(seed), _full(llama, ids_b, **kw), torch.rand(3))[2])


@pytest.mark.slow  # 200 generate calls: the full suite runs it, the per-version matrix does not
def test_sampled_first_token_follows_the_exact_distribution(llama, held):
    """Sampling with ``rebase="verify"``: the first token's empirical distribution over 200 calls matches the exact
    model's (processed, temperature 2) distribution (chi-square goodness of fit, p > 1e-3), although it is drafted
    from another agent's cache whose distribution differs (checked: total variation > 0.3).

    Planted bug that fails it: ``sample_accept`` keeps every draft (the tokens then follow the draft's
    distribution)."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    temp = 2.0
    with torch.no_grad():
        exact_logits = llama(ids_b).logits[0, -1]
    p = torch.softmax(exact_logits / temp, -1)
    probe = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=1, rebase="commit",
                            record_divergence=False)
    draft_logits = _full(llama, ids_b, cache=probe, max_new_tokens=1, do_sample=True, temperature=temp,
                         top_k=0).logits[0][0]
    q = torch.softmax(draft_logits / temp, -1)
    assert 0.5 * float((p - q).abs().sum()) > 0.3
    torch.manual_seed(0)
    counts = torch.zeros_like(p)
    n = 200
    for _ in range(n):
        cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=None, rebase="verify",
                                record_divergence=False)
        out = llama.generate(ids_b, cache=cache, max_new_tokens=1, do_sample=True, temperature=temp, top_k=0)
        counts[int(out[0, -1])] += 1
    keep = p * n >= 5  # chi-square cells with enough expected counts; the rest pooled
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([p[keep] * n, (p[~keep].sum() * n)[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2.0), torch.tensor(chi2 / 2.0)))
    assert pvalue > 1e-3, (chi2, pvalue)


def test_gate_one_is_plain_generate_and_zero_is_commit(llama, held):
    """``rebase="commit"`` with ``gate=1.0`` (every step uncertain): the first step already swaps, so the output is
    plain generate's (tokens and logits); ``gate=0.0`` never swaps early (as commit without a gate).

    Planted bug that fails it: ``_gate`` swaps but does not overwrite ``outputs["logits"]`` (generate then picks the
    gated step's token from the optimistic logits)."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    ref = _full(llama, ids_b, max_new_tokens=8, do_sample=False)
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit", gate=1.0)
    _same_as(_full(llama, ids_b, cache=cache, max_new_tokens=8, do_sample=False), ref)
    assert cache.stats.gated_step == 0 and cache.stats.optimistic_tokens == 0
    plain_commit = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
    zero = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit", gate=0.0)
    a = llama.generate(ids_b, cache=plain_commit, max_new_tokens=8, do_sample=False)
    b = llama.generate(ids_b, cache=zero, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and zero.stats.gated_step is None and zero.stats.swap_step == 6


def test_gate_swaps_at_the_first_uncertain_step(llama, held):
    """With a gate between the steps' margins, the swap happens at the first step whose margin is below it, and
    that step's token is the exact model's choice after the same earlier (optimistic) tokens.

    Planted bug that fails it: ``_gate`` swaps when the margin is at or above the gate (the comparison reversed:
    it swaps at the first confident step). (Comparing raw logit margins instead of probabilities was tried too: it
    swaps at the same step here, an equivalent mutant on this model.)"""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    n = ids_b.shape[1]
    probe = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
    drafts = _full(llama, ids_b, cache=probe, max_new_tokens=6, do_sample=False)
    margins = [float(torch.softmax(s[0], -1).topk(2).values.diff().abs()) for s in drafts.scores[:6]]
    step = min(range(6), key=lambda i: margins[i])
    gate = margins[step] + 1e-6
    first = next(i for i in range(6) if margins[i] < gate)
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit", gate=gate)
    out = llama.generate(ids_b, cache=cache, max_new_tokens=8, do_sample=False)
    assert cache.stats.gated_step == first
    with torch.no_grad():
        exact_next = llama(out[:, : n + first]).logits[0, -1].argmax()
    assert int(out[0, n + first]) == int(exact_next)


def test_gate_tokens_wait_before_a_decisive_token(llama, held):
    """``gate_tokens=``: greedy, the first optimistic step whose greedy choice is a decisive token is gated (the
    tokens before it are the optimistic ones, that step's token is the exact model's choice after them); a token
    that no step would emit gates nothing.

    Planted bug that fails it: ``_decisive_due`` tests the second-ranked token instead of the greedy choice."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    n = ids_b.shape[1]
    probe = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
    drafts = llama.generate(ids_b, cache=probe, max_new_tokens=6, do_sample=False)[0, n:].tolist()
    step = 2 if drafts[2] not in drafts[:2] else next(i for i in range(6) if drafts[i] not in drafts[:i])
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit",
                            gate_tokens=[drafts[step]])
    out = llama.generate(ids_b, cache=cache, max_new_tokens=8, do_sample=False)
    assert cache.stats.gated_step == step and cache.stats.gate_reason == "token"
    assert out[0, n:n + step].tolist() == drafts[:step]
    with torch.no_grad():
        exact_next = llama(out[:, : n + step]).logits[0, -1].argmax()
    assert int(out[0, n + step]) == int(exact_next)
    unused = next(t for t in range(3, 128) if t not in drafts)
    quiet = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit",
                            gate_tokens=torch.tensor([unused]))
    llama.generate(ids_b, cache=quiet, max_new_tokens=8, do_sample=False)
    assert quiet.stats.gated_step is None and quiet.stats.swap_step == 6


def test_gate_tokens_when_sampling_gate_every_step_that_could_draw_one(llama, held):
    """Sampling: a decisive token that the call's processed distribution can draw gates the step (without top-k
    every token can be drawn: the first step is gated, so no optimistic token is emitted); with ``top_k=1`` only
    the greedy choice can be drawn, so a token outside it gates nothing.

    Planted bug that fails it: ``_decisive_due`` applies the greedy rule when sampling (the first step is then not
    gated)."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    n = ids_b.shape[1]
    probe = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
    drafts = llama.generate(ids_b, cache=probe, max_new_tokens=6, do_sample=False)[0, n:].tolist()
    unused = next(t for t in range(3, 128) if t not in drafts)
    every = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit",
                            gate_tokens=[unused])
    torch.manual_seed(0)
    llama.generate(ids_b, cache=every, max_new_tokens=4, do_sample=True, top_k=0)
    assert every.stats.gated_step == 0 and every.stats.optimistic_tokens == 0 and every.stats.gate_reason == "token"
    top1 = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit",
                           gate_tokens=[unused])
    torch.manual_seed(0)
    llama.generate(ids_b, cache=top1, max_new_tokens=8, do_sample=True, top_k=1)
    assert top1.stats.gated_step is None and top1.stats.swap_step == 6


def test_gate_tokens_errors(llama):
    """Bad ``gate_tokens`` are refused at construction, naming the problem."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    with pytest.raises(ValueError, match="rebase='commit'"):
        OptimisticCache(llama, ids_b, cache_a, seq_a, rebase="verify", gate_tokens=[5])
    with pytest.raises(ValueError, match="not token ids"):
        OptimisticCache(llama, ids_b, cache_a, seq_a, rebase="commit", gate_tokens=[5, 10**9])
    with pytest.raises(TypeError, match="iterable of token ids"):
        OptimisticCache(llama, ids_b, cache_a, seq_a, rebase="commit", gate_tokens="Yes")


def test_draft_margins_are_each_optimistic_steps_margin(llama, held):
    """``stats.draft_margins`` holds, for every step decided from the optimistic cache, the top-1 minus top-2
    probability of the scores generate chose from (commit), and one margin per draft under verify: what
    research/optimistic/gate_curve.py reads to replay any gate threshold offline.

    Planted bug that fails it: ``after_forward`` records the top-1 probability instead of top-1 minus top-2."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    commit = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=5, rebase="commit")
    out = _full(llama, ids_b, cache=commit, max_new_tokens=8, do_sample=False)
    margins = [float(torch.softmax(s[0].float(), -1).topk(2).values.diff().abs()) for s in out.scores[:5]]
    assert len(commit.stats.draft_margins) == commit.stats.optimistic_tokens == 5
    torch.testing.assert_close(torch.tensor(commit.stats.draft_margins), torch.tensor(margins), atol=1e-5, rtol=0)
    verify = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=5, rebase="verify")
    llama.generate(ids_b, cache=verify, max_new_tokens=8, do_sample=False)
    s = verify.stats
    assert len(s.draft_margins) == s.accepted_tokens + s.rejected_tokens == 5
    torch.testing.assert_close(torch.tensor(s.draft_margins), torch.tensor(margins), atol=1e-5, rtol=0)


@pytest.mark.parametrize("repair", ["blend", "epic"])
def test_gate_reads_the_repaired_cache(llama, held, repair):
    """``gate=`` with ``repair=`` (issue 23's combined mode): the steps before the gate are the repaired cache's
    (its tokens and margins, as without a gate), the gate fires at the first repaired step below it, and that step's
    token is the exact model's after the same earlier tokens.

    Planted bug that fails it: ``_assemble`` skips the repair when a gate is set (the margins are then the plain
    optimistic cache's)."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    n = ids_b.shape[1]
    kw = dict(max_optimistic_tokens=6, rebase="commit", repair=repair, repair_ratio=0.3, repair_tokens=2)
    probe = OptimisticCache(llama, ids_b, cache_a, seq_a, **kw)
    drafts = llama.generate(ids_b, cache=probe, max_new_tokens=6, do_sample=False)
    margins = probe.stats.draft_margins
    plain = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit")
    llama.generate(ids_b, cache=plain, max_new_tokens=6, do_sample=False)
    assert probe.stats.repaired_tokens > 0 and plain.stats.draft_margins != margins  # the repair changes the margins
    step = min(range(1, 6), key=lambda i: margins[i])  # a step after the first: some repaired tokens come before it
    gate = margins[step] + 1e-6
    first = next(i for i in range(6) if margins[i] < gate)
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, gate=gate, **kw)
    out = llama.generate(ids_b, cache=cache, max_new_tokens=8, do_sample=False)
    assert cache.stats.gated_step == first and cache.stats.repaired_tokens == probe.stats.repaired_tokens
    assert torch.equal(out[:, : n + first], drafts[:, : n + first])
    torch.testing.assert_close(torch.tensor(cache.stats.draft_margins[:first]), torch.tensor(margins[:first]))
    with torch.no_grad():
        exact_next = llama(out[:, : n + first]).logits[0, -1].argmax()
    assert int(out[0, n + first]) == int(exact_next)


@pytest.mark.parametrize("repair", ["blend", "epic"])
def test_full_repair_is_plain_generate(llama, held, repair):
    """Repairing every reused row (``repair_ratio=1``, or ``repair_tokens`` longer than every span) makes the
    optimistic cache exact: commit mode then gives plain generate's tokens and logits.

    Planted bugs that fail it: ``blend_recompute`` skips its second pass (selected rows keep reused K/V above the
    check layer); ``_assemble`` recomputes only the unmatched rows under ``repair="epic"``."""
    ids_a, ids_b = _agents()
    cache_a, seq_a = _donor(llama, ids_a)
    ref = _full(llama, ids_b, max_new_tokens=8, do_sample=False)
    cache = OptimisticCache(llama, ids_b, cache_a, seq_a, max_optimistic_tokens=6, rebase="commit",
                            repair=repair, repair_ratio=1.0, repair_tokens=1000)
    _same_as(_full(llama, ids_b, cache=cache, max_new_tokens=8, do_sample=False), ref)
    assert cache.stats.repaired_tokens > 0 and cache.stats.reused_tokens == 0 and cache.stats.divergent_tokens == 0


def test_session_default_keeps_the_answers(llama):
    """``ReuseSession(policy="optimistic")`` verifies its drafts by default and its answers equal plain generate's (greedy), agent
    after agent; ``rebase="commit"`` is one keyword away.

    Planted bug that fails it: the session's default ``rebase`` is "commit" (answers differ on this random
    model)."""
    doc = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    roles = [torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    s = ReuseSession(llama, policy="optimistic")  # verified drafts by name ("auto" drafts only where they pay)
    fast = ReuseSession(llama, rebase="commit")
    differs = False
    for r in roles:
        ids = torch.cat([r, doc], 1)
        out = s.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, llama.generate(ids, max_new_tokens=8, do_sample=False))
        differs |= not torch.equal(fast.generate(ids, max_new_tokens=8, do_sample=False), out)
    assert s.last_stats.method == "optimistic" and s.last_stats.cache_stats["rebase"] == "verify"
    assert fast.last_stats.cache_stats["rebase"] == "commit" and differs


@pytest.mark.parametrize("rebase, starts_at_once", [("verify", True), ("commit", False)])
def test_auto_background_start_follows_rebase_on_cpu(llama, monkeypatch, rebase, starts_at_once):
    """``background_start="auto"`` on CPU: under ``"verify"`` the exact prefill starts before the optimistic cache is
    assembled (a streamer sees only verified tokens, so the first verified one is the first that counts), under
    ``"commit"`` only after the first token; ``stats.background_start`` says which, and the output is plain
    generate's either way under verify. Planted bug that fails it: "auto" ignores ``rebase`` (starts at once only
    on CUDA) -> under verify the job has not started at assembly."""
    ids_a, ids_b = _agents()
    donor = _donor(llama, ids_a)
    seen = []
    orig = OptimisticCache._assemble

    def spy(self):
        seen.append(self.job.started)
        return orig(self)

    monkeypatch.setattr(OptimisticCache, "_assemble", spy)
    cache = OptimisticCache(llama, ids_b, *donor, rebase=rebase)
    out = llama.generate(ids_b, cache=cache, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         output_logits=True)
    assert seen == [starts_at_once]
    assert cache.stats.background_start == ("immediate" if starts_at_once else "after_first_token")
    if rebase == "verify":
        ref = _full(llama, ids_b, max_new_tokens=4, do_sample=False)
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(torch.cat(out.logits), torch.cat(ref.logits), atol=1e-4, rtol=1e-4)
