"""The kvreuse-text-generation pipeline's context mode (``pipe(context, questions=..., agents=...)``), per-input stats
and ``pipe.sessions``, on SmolLM2 (a real chat template)."""

import pytest
from transformers import pipeline

from hf_kvreuse import OptimisticCache, ReuseSession, SessionStats, output_cache

pytestmark = pytest.mark.slow

DOC = ("The Nile is a major north-flowing river in northeastern Africa. It flows into the Mediterranean Sea. "
       "The Nile is about 6,650 km long and its drainage basin covers eleven countries.")
QS = ["Into which sea does the Nile flow?", "How long is the Nile?"]
ROLES = {"critic": "You are a strict critic.", "writer": "You are a writer for children."}
EXACT = dict(max_optimistic_tokens=0)  # the exact cache before the first token: answers equal full prefill's
GEN = dict(max_new_tokens=6, do_sample=False)


def chat(question, role=None):
    user = {"role": "user", "content": f"{DOC}\n\n{question}"}
    return ([{"role": "system", "content": role}] if role else []) + [user]


@pytest.fixture(scope="module")
def pipes(smollm2):
    model, tok = smollm2
    return (pipeline("kvreuse-text-generation", model=model, tokenizer=tok),
            pipeline("text-generation", model=model, tokenizer=tok))


def stock_answer(stock, messages):
    return stock(messages, return_full_text=False, **GEN)[0]["generated_text"]


def test_questions_share_the_context(pipes):
    """``questions=``: one answer and one SessionStats per question, the answers of the stock pipeline on the same
    chats (greedy), and every question after the first reuses the context as an exact prefix.

    Planted bug that fails it: ``ask`` formats every user message with the first question (``question=qs[0]``):
    the second answer is then the first one again.

    ``method="prefix"`` (exact prefix reuse, no timing): under the default ``"auto"`` which method serves the
    second question is decided by the session's measured call times, so a reuse asserted there depends on the
    machine's load."""
    pipe, stock = pipes
    out = pipe(DOC, questions=QS, method="prefix", **GEN)
    assert out["answers"] == [stock_answer(stock, chat(q)) for q in QS]
    first, second = out["stats"]
    assert isinstance(first, SessionStats) and first is not second
    assert first.exact_prefix_tokens == 0 and second.exact_prefix_tokens > 40 and second.new_tokens < 20
    one = pipe(DOC, question=QS[1], method="prefix", **GEN)
    assert one["answer"] == out["answers"][1] and one["stats"].exact_prefix_tokens > 40


def test_agents_share_the_context_behind_their_roles(pipes):
    """``agents=``: every question asked by every agent, answers keyed by agent; with the exact cache swapped in
    before the first token the answers are the stock pipeline's, and the second agent takes the context from the
    first agent's cache (donor rows)."""
    pipe, stock = pipes
    out = pipe(DOC, questions=QS[:1], agents=ROLES, method="optimistic", method_kwargs=EXACT, **GEN)
    (answers,), (stats,) = out["answers"], out["stats"]
    assert set(answers) == set(ROLES) == set(stats)
    for name, role in ROLES.items():
        assert answers[name] == stock_answer(stock, chat(QS[0], role)), name
        assert stats[name].agent == name
    assert stats["writer"].method == "optimistic" and stats["writer"].donor_tokens > 30
    listed = pipe(DOC, question=QS[0], agents=list(ROLES.values()), method="prefix", **GEN)
    assert listed["answer"] == [answers[n] for n in ROLES] and len(listed["stats"]) == 2


def test_sessions_exist_from_the_start_and_stats_per_input(smollm2, tmp_path):
    """``pipe.sessions["auto"]`` exists before any call; a session assigned to a method serves it (a saved one
    here); a list of chats gets one stats object per input; cache_factory inputs carry their cache's stats."""
    model, tok = smollm2
    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    assert pipe.sessions["auto"].calls == 0 and "auto" in pipe.sessions
    with pytest.raises(KeyError, match="methods"):
        pipe.sessions["nope"]
    outs = pipe([chat(q) for q in QS], method="prefix", **GEN)
    stats = [o[0]["stats"] for o in outs]
    assert [s.prompt_tokens for s in stats] != [0, 0] and stats[0] is not stats[1]
    assert stats[1].exact_prefix_tokens > 40
    pipe.sessions["prefix"].save(tmp_path)
    pipe2 = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    pipe2.sessions["prefix"] = ReuseSession.load(tmp_path, model)
    again = pipe2(chat(QS[0]), method="prefix", **GEN)[0]
    assert again["stats"].exact_prefix_tokens == again["stats"].prompt_tokens - 1
    assert again["generated_text"] == outs[0][0]["generated_text"]
    ids_a = tok.apply_chat_template(chat(QS[0], ROLES["critic"]), add_generation_prompt=True, return_tensors="pt")
    out_a = model.generate(**ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    rec = pipe(chat(QS[0], ROLES["writer"]), cache_factory=lambda m, ids: OptimisticCache(
        m, input_ids=ids, donor_cache=output_cache(out_a), donor_ids=out_a.sequences, rebase="commit"), **GEN)[0]
    assert rec["stats"].reused_tokens > 30


def test_context_mode_errors(pipes):
    pipe, _ = pipes
    with pytest.raises(ValueError, match="exactly one"):
        pipe(DOC, question="a", questions=["b"])
    with pytest.raises(ValueError, match="cache_factory"):
        pipe(DOC, question="a", cache_factory=lambda m, i: None)
    with pytest.raises(TypeError, match="string"):
        pipe(context=[chat("a")], question="a")
