"""``hf-kvreuse``: every option has help text, ``--model`` takes a local model folder, and ``bench.json`` is written
after every question (a stopped run keeps what it measured)."""

import argparse
import json

import pytest

from hf_kvreuse.cli import build_parser, main


def test_every_option_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and "see module docstring" not in action.help, (name, action.dest)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--model", "no/such/folder"])


def test_bench_refuses_a_bad_method_spec_before_loading():
    """``--methods`` specs are checked before any model loads: an unknown mode, a malformed option, a policy the
    bench cannot run."""
    for spec, match in (("auto-verfy", "auto-verfy"), ("auto-verify:4", "not key=value"),
                        ("translated:recompute_ratio=0.3", "needs a source model"),
                        ("auto-verify:max_optimstic_tokens=4", "not an option of any")):
        with pytest.raises(SystemExit, match=match):
            main(["bench", "--methods", spec, "--out", "/nonexistent/never"])


@pytest.fixture(scope="module")
def model_folder(smollm2, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (and chat template), saved as any user's model folder."""
    from hf_kvreuse.models import tiny_model

    _, tok = smollm2
    folder = tmp_path_factory.mktemp("my_model")
    model = tiny_model("llama", vocab_size=len(tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_bench_on_a_model_folder(model_folder, tmp_path):
    out = tmp_path / "b"
    assert main(["bench", "--model", str(model_folder), "--dtype", "fp32", "--n", "1", "--workflows", "chain",
                 "--methods", "prefix,auto-verify:max_optimistic_tokens=2", "--context-tokens", "120",
                 "--max-new-tokens", "2", "--out", str(out)]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["complete"] and res["config"]["model"] == str(model_folder)
    assert {r["method"] for r in res["summary"]} == {"full", "prefix", "auto-verify:max_optimistic_tokens=2"}


@pytest.mark.slow
def test_bench_json_after_every_question(model_folder, tmp_path, monkeypatch):
    """A run stopped during its second question leaves bench.json with the first question's records of every
    method (``complete: false``).

    Planted bug that fails it: ``main`` passes no ``checkpoint`` to ``run`` (bench.json only at the end)."""
    import hf_kvreuse.workflows.graphs as graphs

    calls = {"n": 0}
    real = graphs.run_workflow

    def stop_on_second_question(*a, **k):
        calls["n"] += 1
        if calls["n"] > 2:  # full and prefix of question 0 done
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(graphs, "run_workflow", stop_on_second_question)
    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--model", str(model_folder), "--n", "2", "--workflows", "chain", "--methods", "prefix",
              "--context-tokens", "120", "--max-new-tokens", "2", "--out", str(out)])
    res = json.loads((out / "bench.json").read_text())
    assert res["complete"] is False
    assert sorted((r["question"], r["method"]) for r in res["records"]) == [(0, "full"), (0, "prefix")]
    assert res["summary"] and not list(out.glob(".bench.json.*"))


def _bench_file(path, seed, methods_by_q, reference=None, **cfg):
    """A hand-made bench.json: ``methods_by_q`` maps a question to the methods run on it."""
    turn = {"stats": {"ttft_s": 1.0, "prompt_tokens": 10, "exact_prefix_tokens": 0, "donor_tokens": 0,
                      "cache_stats": None}, "ttft_ratio": 1.0, "wall_s": 1.0, "agent": "a"}
    records = []
    for q, methods in methods_by_q.items():
        for m in methods:
            rec = dict(workflow="chain", context_tokens=100, question=q, method=m, final="x", correct=True,
                       agrees=True, judge_agrees=None, e2e_s=1.0, e2e_ratio=1.0, turns=[turn])
            if m == "full" and reference:
                rec["reference"] = reference
            records.append(rec)
    config = dict(model="m", dtype="fp32", rounds=3, max_new_tokens=4, max_bytes=1, seed=seed, n=4, **cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(config=config, records=records)))
    return str(path)


def test_merge_joins_methods_and_spans_of_one_configuration(tmp_path):
    """``merge`` names a question by its seed/n and index: a ``--reference`` run's copied full records fold into
    the originals (one full record per question), spans of the same seed join, other seeds stay apart, and a method
    measured twice on one question or runs of another configuration are refused.

    Planted bug that fails it: naming questions by file index (``f"{i}:{q}"``, the old merge): full counted 4 times."""
    from hf_kvreuse.cli import merge

    a = _bench_file(tmp_path / "a.json", 0, {0: ["full", "verify"], 1: ["full", "verify"]})
    b = _bench_file(tmp_path / "b.json", 0, {0: ["full", "prefix"], 1: ["full", "prefix"]}, reference=a)
    c = _bench_file(tmp_path / "c.json", 0, {2: ["full", "verify"]})       # a later span of the same pick
    d = _bench_file(tmp_path / "d.json", 20, {0: ["full", "verify"]})      # another seed: other questions
    res = merge([b, a, c, d], tmp_path / "m")
    n = {r["method"]: r["n"] for r in res["summary"]}
    assert n == {"full": 4, "verify": 4, "prefix": 2}
    assert not any(r.get("reference") for r in res["records"])  # the measured originals were kept
    assert [r["method"] for r in res["summary"]][0] == "full"
    with pytest.raises(SystemExit, match="in two runs"):
        merge([a, _bench_file(tmp_path / "e.json", 0, {1: ["verify"]})], tmp_path / "m2")
    with pytest.raises(SystemExit, match="max_new_tokens"):
        other = _bench_file(tmp_path / "f.json", 40, {0: ["full"]})
        cfg = json.loads(open(other).read())
        cfg["config"]["max_new_tokens"] = 128
        open(other, "w").write(json.dumps(cfg))
        merge([a, other], tmp_path / "m3")


def test_reference_may_be_a_merged_file(tmp_path):
    """``--reference`` accepts a merged bench.json: it takes the full-prefill records of this run's seed and n (named
    ``seed/n:index`` there) under their plain index, checks those runs' settings, and refuses a seed it lacks.

    Planted bug that fails it: the merged records keep their ``seed/n:index`` names (the lookup by index then finds
    none: "has no full-prefill record")."""
    import argparse

    from hf_kvreuse.cli import load_reference, merge

    a = _bench_file(tmp_path / "a.json", 0, {0: ["full", "prefix"], 1: ["full", "prefix"]})
    b = _bench_file(tmp_path / "b.json", 20, {0: ["full", "prefix"]})
    merge([a, b], tmp_path / "m")
    base = dict(model="m", dtype="fp32", rounds=3, max_new_tokens=4, max_bytes=1, n=4, workflows=["chain"],
                context_tokens=[100], reference=str(tmp_path / "m" / "bench.json"))
    ref = load_reference(argparse.Namespace(seed=0, questions="0:2", **base))
    assert sorted(ref) == [("chain", 100, 0), ("chain", 100, 1)] and ref[("chain", 100, 1)]["question"] == 1
    assert sorted(load_reference(argparse.Namespace(seed=20, questions="0:1", **base))) == [("chain", 100, 0)]
    with pytest.raises(SystemExit, match="no run of seed 7"):
        load_reference(argparse.Namespace(seed=7, questions="0:1", **base))
    with pytest.raises(SystemExit, match="max_new_tokens"):
        load_reference(argparse.Namespace(seed=0, questions="0:1", **dict(base, max_new_tokens=8)))
