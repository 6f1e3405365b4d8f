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
                 "--methods", "prefix", "--context-tokens", "120", "--max-new-tokens", "2", "--out", str(out)]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["complete"] and res["config"]["model"] == str(model_folder)
    assert {r["method"] for r in res["summary"]} == {"full", "prefix"}


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
