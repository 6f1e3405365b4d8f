"""Workflows through ReuseSession, the pipeline's method=, and the bench CLI, on SmolLM2 (offline)."""

import json

import pytest
import torch

from hf_kvreuse.workflows.graphs import SHAPES, parse_choice, run_workflow
from hf_kvreuse.session import ReuseSession

pytestmark = pytest.mark.slow

DOC = ("The Nile is a major north-flowing river in northeastern Africa. It flows into the Mediterranean Sea. "
       "The Nile is about 6,650 km long and its drainage basin covers eleven countries. In ancient times the "
       "river's yearly flood made farming possible along its banks, and most of Egypt's people still live "
       "near it.")
QUESTION = "Into which sea does the Nile flow?"
EXACT = dict(max_optimistic_tokens=0)  # the exact cache before the first token: outputs must equal full prefill


def test_fully_connected_auto_equals_full_and_reuses(smollm2):
    """3 agents x 2 rounds, fully connected: with the exact cache swapped in before the first token, ``optimistic``
    gives every answer of full prefill, while its later calls take most of their prompt from held caches.

    Planted bug that fails it: the background prefill starts at 0 with the exact prefix loaded (``range(0, ...)``
    in ``BackgroundPrefill._prefill``): the swapped-in cache holds the prefix twice and the answers change."""
    model, tok = smollm2
    full = run_workflow(ReuseSession(model, policy="full"), tok, DOC, QUESTION, rounds=2, max_new_tokens=8)
    auto = run_workflow(ReuseSession(model, policy="optimistic", method_kwargs=EXACT), tok, DOC, QUESTION, rounds=2,
                        max_new_tokens=8)
    assert [t.answer for t in auto.turns] == [t.answer for t in full.turns]
    assert auto.final == full.final and len(auto.turns) == 6
    later = auto.turns[1:]
    reused = [(t.stats["exact_prefix_tokens"] + t.stats["donor_tokens"]) / t.prompt_tokens for t in later]
    assert min(reused) > 0.5, reused
    assert any(t.stats["method"] == "optimistic" for t in later)
    assert all(t.stats["exact"] for t in auto.turns)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_runs(smollm2, shape):
    model, tok = smollm2
    s = ReuseSession(model, policy="prefix")
    run = run_workflow(s, tok, DOC, QUESTION, shape=shape, rounds=2, max_new_tokens=4)
    n_agents = 3
    expected = {"chain": n_agents, "fully_connected": 2 * n_agents, "debate": 2 * n_agents,
                "judge": n_agents + 1}[shape]
    assert len(run.turns) == expected and run.final
    assert run.as_dict()["e2e_s"] > 0 and "prompt_ids" not in run.as_dict()["turns"][0]
    if shape == "judge":
        assert run.turns[-1].agent == "judge"


def test_parse_choice():
    assert parse_choice("Candidate 2 is right", 3) == 2
    assert parse_choice("7, no 3", 3) == 3
    assert parse_choice("none", 3) is None


def test_workflow_errors(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="shape"):
        run_workflow(ReuseSession(model), tok, DOC, QUESTION, shape="star")
    with pytest.raises(ValueError, match="rounds"):
        run_workflow(ReuseSession(model), tok, DOC, QUESTION, rounds=0)


def test_pipeline_method_list_equals_separate_calls(smollm2):
    """``method=`` serves a list of prompts through one session: the answers equal separate calls' and, with the
    exact cache before the first token, the stock pipeline's; the later prompts reuse the earlier ones."""
    from transformers import pipeline

    model, tok = smollm2
    msgs = [[{"role": "system", "content": role}, {"role": "user", "content": f"{DOC}\n\n{QUESTION}"}]
            for role in ("You are a researcher.", "You are a strict critic.", "You are a writer.")]
    kw = dict(method="optimistic", method_kwargs=EXACT, max_new_tokens=10, do_sample=False)
    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    together = pipe(msgs, **kw)
    pipe2 = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    separate = [pipe2(m, **kw)[0] for m in msgs]
    stock = pipeline("text-generation", model=model, tokenizer=tok)(msgs, max_new_tokens=10, do_sample=False)
    last = lambda outs: [o[0]["generated_text"][-1]["content"] if isinstance(o, list) else  # noqa: E731
                         o["generated_text"][-1]["content"] for o in outs]
    assert last(together) == last(separate) == last(stock)
    (session,) = pipe.sessions.values()
    assert session.calls == 3 and session.last_stats.donor_tokens > 50
    with pytest.raises(ValueError, match="method"):
        pipe(msgs[0], method="nope")


def test_bench_cli(smollm2, tmp_path):
    """``hf-kvreuse bench`` on one tiny cell writes JSON, CSV and the three plots; prefix agrees with full."""
    from hf_kvreuse.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--model", "smollm2", "--n", "1", "--workflows", "chain,judge", "--methods",
                 "prefix,auto", "--context-tokens", "150", "--max-new-tokens", "3", "--floor", "--out",
                 str(out)]) == 0
    for f in ("bench.json", "bench.csv", "ttft.png", "accuracy_vs_ttft.png", "timelines.png"):
        assert (out / f).exists(), f
    res = json.loads((out / "bench.json").read_text())
    rows = {(r["workflow"], r["method"]): r for r in res["summary"]}
    assert set(rows) == {(w, m) for w in ("chain", "judge") for m in ("full", "prefix", "auto")}
    assert rows[("chain", "prefix")]["agreement"] == 1.0 and rows[("judge", "full")]["judge_consistency"] == 1.0
    assert "ttft_over_floor" in rows[("chain", "auto")]
    # prefix is exact: paired accuracy difference with full prefill 0 on the same questions
    assert rows[("chain", "prefix")]["accuracy_minus_full"] == 0.0 and "accuracy_minus_full" not in rows[("chain", "full")]
    assert res["git_commit"]


def test_agents_with_own_adapter_or_model(smollm2):
    """Agents may run their own LoRA adapter or their own model: each call runs under it (answers equal a
    full-prefill run of the same workflow), and K/V made under one adapter are never another's exact prefix.

    Planted bug that fails it: ``run_workflow`` ignores ``agent.adapter`` (no ``set_adapter``): the agents then
    all run the adapter that happened to be active, and their answers differ from plain generate of the same
    prompt under their own adapter."""
    from peft import LoraConfig, get_peft_model

    from hf_kvreuse import enable
    from hf_kvreuse.models import tiny_model
    from hf_kvreuse.workflows import DEFAULT_AGENTS, Agent

    _, tok = smollm2
    vocab = len(tok)
    cfg = dict(r=4, target_modules=["v_proj"], init_lora_weights=False)
    pm = get_peft_model(tiny_model("llama", vocab_size=vocab), LoraConfig(**cfg), adapter_name="writer_lora")
    pm.add_adapter("critic_lora", LoraConfig(**cfg))
    enable(pm)
    other = enable(tiny_model("llama", seed=3, vocab_size=vocab))
    r, c, w = DEFAULT_AGENTS
    agents = [Agent(r.name, r.system, r.instruction, model=other), Agent(c.name, c.system, c.instruction,
              adapter="critic_lora"), Agent(w.name, w.system, w.instruction, adapter="writer_lora")]
    sessions = {}
    pm.set_adapter("critic_lora")  # the wrong one for the writer: the workflow must switch
    got = run_workflow(ReuseSession(pm, policy="auto", method_kwargs=EXACT), tok, DOC, QUESTION, agents=agents,
                       rounds=2, max_new_tokens=5, sessions=sessions)
    assert len(sessions) == 1 and next(iter(sessions.values())).model is other
    by_name = {a.name: a for a in agents}
    for t in got.turns:  # each answer is plain generate of its prompt under the agent's own weights
        agent = by_name[t.agent]
        m = agent.model or pm
        if agent.adapter:
            pm.set_adapter(agent.adapter)
        ids = t.prompt_ids
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        assert t.answer == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip(), t.agent
    assert all(t.stats["exact"] for t in got.turns)


def test_bench_merge(smollm2, tmp_path):
    """``hf-kvreuse merge`` joins shards of one configuration: the cells count every question once."""
    from hf_kvreuse.cli import main

    outs = []
    for seed in (0, 7):
        out = tmp_path / f"s{seed}"
        main(["bench", "--model", "smollm2", "--n", "1", "--seed", str(seed), "--workflows", "chain", "--methods",
              "prefix", "--context-tokens", "120", "--max-new-tokens", "2", "--out", str(out)])
        outs.append(str(out / "bench.json"))
    assert main(["merge", *outs, "--out", str(tmp_path / "m")]) == 0
    res = json.loads((tmp_path / "m" / "bench.json").read_text())
    assert {r["method"]: r["n"] for r in res["summary"]} == {"full": 2, "prefix": 2}


def test_bench_reference_reuses_full_prefill(smollm2, tmp_path):
    """``--reference``: a second run reuses the first run's full-prefill records (marked as such) and computes the
    same agreement; a reference of other settings is refused before anything runs."""
    from hf_kvreuse.cli import main

    common = ["bench", "--model", "smollm2", "--n", "1", "--workflows", "chain", "--context-tokens", "150",
              "--max-new-tokens", "3"]
    assert main([*common, "--methods", "prefix", "--out", str(tmp_path / "a")]) == 0
    ref = str(tmp_path / "a" / "bench.json")
    assert main([*common, "--methods", "prefix", "--reference", ref, "--out", str(tmp_path / "b")]) == 0
    res = json.loads((tmp_path / "b" / "bench.json").read_text())
    full = [r for r in res["records"] if r["method"] == "full"]
    assert len(full) == 1 and full[0]["reference"] == ref
    assert {r["method"]: r["agreement"] for r in res["summary"]} == {"full": 1.0, "prefix": 1.0}
    with pytest.raises(SystemExit, match="max_new_tokens"):
        main([*common[:-1], "4", "--methods", "prefix", "--reference", ref, "--out", str(tmp_path / "c")])


def test_bench_questions_runs_a_span_and_completes_with_a_reference(smollm2, tmp_path):
    """``--questions A:B`` runs only those of the ``--n`` questions (the same prompts as a whole run picks), and a
    ``--reference`` needs full-prefill records of that span only; a bad span is refused before anything runs.

    Planted bug that fails it: ``run`` loops over ``range(args.n)`` instead of the span (records of question 0)."""
    from hf_kvreuse.cli import main

    common = ["bench", "--model", "smollm2", "--n", "2", "--workflows", "chain", "--context-tokens", "120",
              "--max-new-tokens", "2"]
    assert main([*common, "--methods", "prefix", "--questions", "1:2", "--out", str(tmp_path / "a")]) == 0
    res = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert sorted({r["question"] for r in res["records"]}) == [1]
    ref = str(tmp_path / "a" / "bench.json")
    assert main([*common, "--methods", "auto", "--questions", "1:", "--reference", ref,
                 "--out", str(tmp_path / "b")]) == 0
    res_b = json.loads((tmp_path / "b" / "bench.json").read_text())
    full = [r for r in res_b["records"] if r["method"] == "full"]
    assert [r["question"] for r in full] == [1] and full[0]["reference"] == ref
    with pytest.raises(SystemExit, match="no full-prefill record"):
        main([*common, "--methods", "auto", "--questions", "0:1", "--reference", ref, "--out", str(tmp_path / "c")])
    for bad in ("2:3", "1:1", "x"):
        with pytest.raises(SystemExit, match="--questions"):
            main([*common, "--methods", "prefix", "--questions", bad, "--out", str(tmp_path / "d")])
