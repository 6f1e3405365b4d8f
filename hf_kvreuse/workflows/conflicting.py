"""Conflicting-task records: two agents read the same block under opposite objectives (METHODS.md §2.2, §4.3).

The record shape of the LatentRemedy harness (chenzhwsysu57/kvreuse ``kvreuse_data/schema.py``):
``prefix_a, prefix_b, shared_block, question, gold_a, gold_b`` with ``gold_a != gold_b``. The question is the same
for both agents, so only the agent's own prefix says what to do: exactly what direct reuse of a block computed
under the *other* prefix puts at risk.

Every family's answers are checkable by construction (seeded generators, no model involved):

* ``utility``: each agent picks the allocation that maximises its own item values (Deal-or-No-Deal style);
* ``retrieval``: each agent reports the value of its own key in a key-value list;
* ``count``: each agent counts the objects with its own attribute (colour vs size);
* ``extract``: each agent extracts its own field of a record card (e.g. city vs year);
* ``years``: on a real SQuAD passage with at least two distinct years, one agent reports the earliest year
  mentioned, the other the latest;
* ``order``: each agent names the first or the last item of a list;
* ``inventory``: each agent reports the stock of its own product in a stock list;
* ``schedule``: each agent reports the time of its own event in a timetable;
* ``squad-pair``: a real SQuAD passage with two of its questions whose answers differ; each agent's prefix
  carries its own question;
* more layouts: ``phonebook`` (name -> extension, dotted leaders), ``prices`` (markdown table), ``gates`` (flight ->
  gate sentences), ``specs`` (spec-sheet fields), ``json`` (a JSON object), ``rooms`` (guest -> room sentences),
  ``code`` (Python functions returning constants), ``narrative`` (a prose story), ``minmax`` (most vs fewest units),
  ``inverse`` (value -> key).

:data:`TRAIN_FAMILIES` and :data:`HELDOUT_FAMILIES` are disjoint: a bridge is trained on the first and evaluated
on the second.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

# chosen by the screens in the research notes (Qwen2.5-Coder-0.5B): the first four are families the model solves
# with full prefill and where direct reuse loses >= 15 points; the shipped gated bridge was trained on all eight
# (json, rooms, gates, specs: more layouts, kept although the model solves gates rarely and reuse keeps some specs).
# Held out: retrieval and extract (lookup list, record card) and code (Python source: another shape than every
# training family); the others (utility, count, minmax, inverse, narrative: the model cannot do them with full
# prefill; order, years: reuse keeps most answers) stay available for measurement
TRAIN_FAMILIES = ("inventory", "schedule", "phonebook", "prices", "json", "rooms", "gates", "specs")
HELDOUT_FAMILIES = ("retrieval", "extract", "code")
QUESTION = "Give only your answer, nothing else."


@dataclass(frozen=True)
class ConflictRecord:
    family: str
    prefix_a: str
    prefix_b: str
    shared_block: str
    question: str
    gold_a: str
    gold_b: str

    def as_dict(self) -> dict:
        return asdict(self)

    def prefix(self, side: str) -> str:
        return self.prefix_a if side == "a" else self.prefix_b

    def gold(self, side: str) -> str:
        return self.gold_a if side == "a" else self.gold_b


_ITEMS = ("books", "hats", "balls")
_NAMES = ("Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
          "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara")
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Dakar", "Perth", "Bergen", "Cusco",
           "Tbilisi", "Accra", "Bogota", "Kyoto", "Porto", "Riga")
_JOBS = ("baker", "pilot", "nurse", "architect", "chemist", "farmer", "librarian", "welder", "judge", "painter")
_COLOURS = ("red", "blue", "green", "yellow")
_SIZES = ("small", "large")
_SHAPES = ("box", "ball", "cup", "book", "key", "lamp")
_WORDS = ("apple", "river", "candle", "mirror", "tiger", "violin", "pepper", "anchor", "glacier", "saddle",
          "button", "comet", "ladder", "marble", "needle", "orchid", "pillow", "quartz", "rocket", "spider")


def _utility(rng: random.Random) -> ConflictRecord:
    while True:
        va = [rng.randint(0, 9) for _ in _ITEMS]
        vb = [rng.randint(0, 9) for _ in _ITEMS]
        options = [[rng.randint(0, 3) for _ in _ITEMS] for _ in range(5)]
        ua = [sum(x * v for x, v in zip(o, va)) for o in options]
        ub = [sum(x * v for x, v in zip(o, vb)) for o in options]
        ia, ib = max(range(5), key=ua.__getitem__), max(range(5), key=ub.__getitem__)
        if ua.count(ua[ia]) == 1 and ub.count(ub[ib]) == 1 and ia != ib:
            break
    letters = "ABCDE"
    block = "Candidate allocations (how many of each item you would receive):\n" + "\n".join(
        f"[{letters[i]}] " + ", ".join(f"{n} {it}" for n, it in zip(o, _ITEMS)) for i, o in enumerate(options))

    def prefix(name, vals):
        return (f"You are {name}. Your value per item is: " + ", ".join(f"{it} = {v}" for it, v in zip(_ITEMS, vals))
                + ". Choose the allocation with the highest total value for you. Answer with its letter only.")

    return ConflictRecord("utility", prefix("Agent A", va), prefix("Agent B", vb), block, QUESTION, letters[ia],
                          letters[ib])


def _lookup(rng: random.Random, family: str, names, n: int, lo: int, hi: int, title: str, line: str,
            tmpl: str) -> ConflictRecord:
    """A list of ``n`` (name, number) entries; each agent reports the number of its own entry."""
    keys = rng.sample(names, n)
    vals = [str(rng.randint(lo, hi)) for _ in keys]
    a, b = rng.sample(range(n), 2)
    block = f"{title}:\n" + "\n".join(line.format(k, v) for k, v in zip(keys, vals))
    return ConflictRecord(family, tmpl.format(keys[a]), tmpl.format(keys[b]), block, QUESTION, vals[a], vals[b])


def _retrieval(rng: random.Random) -> ConflictRecord:
    return _lookup(rng, "retrieval", _WORDS, 12, 100, 999, "Registry", "{}: {}",
                   "You are in charge of the entry '{}'. Report the number stored for your entry.")


def _count(rng: random.Random) -> ConflictRecord:
    while True:
        objs = [(rng.choice(_COLOURS), rng.choice(_SIZES), rng.choice(_SHAPES)) for _ in range(8)]
        colour, size = rng.choice(_COLOURS), rng.choice(_SIZES)
        na = sum(o[0] == colour for o in objs)
        nb = sum(o[1] == size for o in objs)
        if na != nb and na > 0 and nb > 0:
            break
    block = "Objects on the table:\n" + "\n".join(f"- a {c} {s} {sh}" for c, s, sh in objs)
    return ConflictRecord("count", f"You only care about {colour} objects. Count how many {colour} objects there are. "
                                   "Answer with a number.",
                          f"You only care about {size} objects. Count how many {size} objects there are. Answer "
                          "with a number.", block, QUESTION, str(na), str(nb))


def _extract(rng: random.Random) -> ConflictRecord:
    name = rng.choice(_NAMES)
    card = {"name": name, "city": rng.choice(_CITIES), "job": rng.choice(_JOBS), "year": str(rng.randint(1950, 2005)),
            "pet": rng.choice(("cat", "dog", "parrot", "rabbit", "turtle"))}
    fa, fb = rng.sample(["city", "job", "year", "pet"], 2)
    block = "Record card:\n" + "\n".join(f"{k}: {v}" for k, v in card.items())
    what = {"city": "the city", "job": "the job", "year": "the year of birth", "pet": "the pet"}
    tmpl = "You extract {} from record cards. Report only that field's value."
    return ConflictRecord("extract", tmpl.format(what[fa]), tmpl.format(what[fb]), block, QUESTION, card[fa], card[fb])


_PRODUCTS = ("lamps", "chairs", "kettles", "drills", "scarves", "boots", "pillows", "mirrors", "radios", "tents",
             "helmets", "jackets", "ladders", "blenders")
_EVENTS = ("budget review", "team lunch", "fire drill", "client call", "design sprint", "board meeting", "yoga class",
           "code review", "press briefing", "safety audit", "hiring panel", "product demo")


def _inventory(rng: random.Random) -> ConflictRecord:
    return _lookup(rng, "inventory", _PRODUCTS, 10, 10, 99, "Stock list", "{} - {} units",
                   "You manage the {} department. Report how many units of your product are in stock.")


def _schedule(rng: random.Random) -> ConflictRecord:
    events = rng.sample(_EVENTS, 8)
    times = rng.sample([f"{h}:{m:02d}" for h in range(7, 19) for m in (0, 15, 30, 45)], 8)
    a, b = rng.sample(range(8), 2)
    block = "Timetable:\n" + "\n".join(f"{e}: {t}" for t, e in zip(times, events))
    tmpl = "You organise the {}. Report the time it starts."
    return ConflictRecord("schedule", tmpl.format(events[a]), tmpl.format(events[b]), block, QUESTION, times[a],
                          times[b])


def _squad_pairs(seed: int, n: int) -> list[ConflictRecord]:
    from .datasets import normalize_answer, squad

    by_passage: dict[str, list] = {}
    for it in squad():
        by_passage.setdefault(it.passage, []).append(it)
    rng = random.Random(seed)
    keys = sorted(by_passage)
    rng.shuffle(keys)
    out = []
    for p in keys:
        qs = by_passage[p]
        for i in range(len(qs)):
            for j in range(i + 1, len(qs)):
                a, b = qs[i], qs[j]
                na, nb = {normalize_answer(x) for x in a.answers}, {normalize_answer(x) for x in b.answers}
                if na & nb or any(x in y or y in x for x in na for y in nb):
                    continue
                tmpl = "You answer this question about the passage: {}"
                out.append(ConflictRecord("squad-pair", tmpl.format(a.question), tmpl.format(b.question),
                                          "Passage: " + p, QUESTION, a.answers[0], b.answers[0]))
                break
            else:
                continue
            break
        if len(out) == n:
            break
    return out


def _order(rng: random.Random) -> ConflictRecord:
    words = rng.sample(_WORDS, 7)
    block = "List: " + ", ".join(words) + "."
    return ConflictRecord("order", "You report the FIRST word of the list.", "You report the LAST word of the list.",
                          block, QUESTION, words[0], words[-1])


_YEARS = re.compile(r"\b(1[0-9]{3}|20[0-2][0-9])\b")


def _years_records(seed: int, n: int) -> list[ConflictRecord]:
    from .datasets import squad

    rng = random.Random(seed)
    out, seen = [], set()
    items = squad()
    order = list(range(len(items)))
    rng.shuffle(order)
    for i in order:
        p = items[i].passage
        years = sorted({int(y) for y in _YEARS.findall(p)})
        if p in seen or len(years) < 2 or len(p) > 900:
            continue
        seen.add(p)
        out.append(ConflictRecord("years", "You report the EARLIEST year mentioned in the passage.",
                                  "You report the LATEST year mentioned in the passage.", "Passage: " + p, QUESTION,
                                  str(years[0]), str(years[-1])))
        if len(out) == n:
            break
    return out


# -- more families: other layouts and field pairs, and a prose family of another shape -------------
_PEOPLE = _NAMES + ("Ada", "Boris", "Clara", "Diego", "Elif", "Femi", "Greta", "Hugo", "Ines", "Jonas", "Kira",
                    "Luca", "Mina", "Nils", "Olga", "Pavel")
_MATERIALS = ("steel", "oak", "glass", "cotton", "bamboo", "leather", "copper", "wool", "marble", "nylon")
_COUNTRIES = ("Chile", "Kenya", "Japan", "Norway", "Peru", "Ghana", "Vietnam", "Estonia", "Morocco", "Canada")


def _phonebook(rng: random.Random) -> ConflictRecord:
    """Name -> four-digit extension, a staff directory with dotted leaders."""
    names = rng.sample(_PEOPLE, 10)
    exts = rng.sample(range(1000, 9999), 10)
    a, b = rng.sample(range(10), 2)
    block = "Staff directory:\n" + "\n".join(f"{n} ........ ext. {x}" for n, x in zip(names, exts))
    tmpl = "You need to call {}. Report their phone extension."
    return ConflictRecord("phonebook", tmpl.format(names[a]), tmpl.format(names[b]), block, QUESTION, str(exts[a]),
                          str(exts[b]))


def _prices(rng: random.Random) -> ConflictRecord:
    """Item -> price, a markdown table."""
    items = rng.sample(_PRODUCTS + _SHAPES, 9)
    prices = [f"{rng.randint(2, 89)}.{rng.choice(range(10, 100, 5))}" for _ in items]
    while len(set(prices)) < len(prices):
        prices = [f"{rng.randint(2, 89)}.{rng.choice(range(10, 100, 5))}" for _ in items]
    a, b = rng.sample(range(9), 2)
    block = "| item | price (USD) |\n|---|---|\n" + "\n".join(f"| {i} | {p} |" for i, p in zip(items, prices))
    tmpl = "You are buying {}. Report the price of your item."
    return ConflictRecord("prices", tmpl.format(items[a]), tmpl.format(items[b]), block, QUESTION, prices[a],
                          prices[b])


def _gates(rng: random.Random) -> ConflictRecord:
    """Flight code -> gate, one sentence per line."""
    codes = [f"{rng.choice(('BA', 'LH', 'AF', 'KL', 'QR', 'TK', 'EK', 'SQ'))}{rng.randint(100, 989)}" for _ in range(9)]
    while len(set(codes)) < 9:
        codes = [f"{rng.choice(('BA', 'LH', 'AF', 'KL', 'QR', 'TK'))}{rng.randint(100, 989)}" for _ in range(9)]
    gates = rng.sample([f"{c}{n}" for c in "ABCDEF" for n in range(1, 30)], 9)
    cities = [rng.choice(_CITIES) for _ in codes]
    a, b = rng.sample(range(9), 2)
    block = "Departures board:\n" + "\n".join(f"Flight {c} to {t} boards at gate {g}." for c, t, g in
                                             zip(codes, cities, gates))
    tmpl = "You are a passenger on flight {}. Report the gate of your flight."
    return ConflictRecord("gates", tmpl.format(codes[a]), tmpl.format(codes[b]), block, QUESTION, gates[a], gates[b])


def _specs(rng: random.Random) -> ConflictRecord:
    """A product spec sheet; each agent extracts its own field (other fields and layout than ``extract``)."""
    sheet = {"model": f"{rng.choice(('XR', 'QT', 'ZN', 'PL'))}-{rng.randint(10, 99)}",
             "material": rng.choice(_MATERIALS), "made in": rng.choice(_COUNTRIES),
             "weight": f"{rng.randint(2, 40)} kg", "warranty": f"{rng.randint(1, 9)} years",
             "colour": rng.choice(("black", "white", "silver", "olive", "navy", "orange"))}
    fa, fb = rng.sample(["material", "made in", "weight", "warranty", "colour"], 2)
    block = "Spec sheet\n" + "\n".join(f"- {k.upper()} = {v}" for k, v in sheet.items())
    what = {"material": "the material", "made in": "the country of manufacture", "weight": "the weight",
            "warranty": "the warranty period", "colour": "the colour"}
    tmpl = "You check {} of products. Report only that value."
    return ConflictRecord("specs", tmpl.format(what[fa]), tmpl.format(what[fb]), block, QUESTION, sheet[fa],
                          sheet[fb])


def _json(rng: random.Random) -> ConflictRecord:
    """Key -> value in a JSON object."""
    keys = rng.sample(_WORDS + _SHAPES, 10)
    vals = rng.sample(range(10, 999), 10)
    a, b = rng.sample(range(10), 2)
    block = "config = {\n" + ",\n".join(f'  "{k}_limit": {v}' for k, v in zip(keys, vals)) + "\n}"
    tmpl = "You maintain the setting \"{}_limit\". Report its value in the config."
    return ConflictRecord("json", tmpl.format(keys[a]), tmpl.format(keys[b]), block, QUESTION, str(vals[a]),
                          str(vals[b]))


def _rooms(rng: random.Random) -> ConflictRecord:
    """Person -> room number, as sentences."""
    names = rng.sample(_PEOPLE, 9)
    rooms = rng.sample(range(100, 999), 9)
    a, b = rng.sample(range(9), 2)
    block = "Hotel guests:\n" + "\n".join(f"{n} is staying in room {r}." for n, r in zip(names, rooms))
    tmpl = "You are looking for {}. Report the room number of your guest."
    return ConflictRecord("rooms", tmpl.format(names[a]), tmpl.format(names[b]), block, QUESTION, str(rooms[a]),
                          str(rooms[b]))


def _narrative(rng: random.Random) -> ConflictRecord:
    """A short prose story (no list, no table): several people, each travels to a city; each agent follows one
    person. Another shape than the lookup lists and cards: entities and answers sit inside running text."""
    names = rng.sample(_PEOPLE, 5)
    cities = rng.sample(_CITIES, 5)
    jobs = rng.sample(_JOBS, 5)
    verbs = ("took the night train to", "flew to", "drove all the way to", "sailed to", "moved to")
    sents = [f"{n}, a {j}, {rng.choice(verbs)} {c}" for n, c, j in zip(names, cities, jobs)]
    links = (" Meanwhile, ", " A week later, ", " That same spring, ", " Not long after, ")
    text = "Last year the friends scattered. " + sents[0] + "." + "".join(
        rng.choice(links) + s + "." for s in sents[1:])
    text += " They still write to each other every month."
    a, b = rng.sample(range(5), 2)
    tmpl = "You are writing {}'s biography. Report the city that {} went to."
    return ConflictRecord("narrative", tmpl.format(names[a], names[a]), tmpl.format(names[b], names[b]),
                          "Story: " + text, QUESTION, cities[a], cities[b])


def _minmax(rng: random.Random) -> ConflictRecord:
    """Opposite aggregates over one list: the product with the most units vs the fewest."""
    items = rng.sample(_PRODUCTS, 8)
    vals = rng.sample(range(10, 99), 8)
    block = "Stock list:\n" + "\n".join(f"{i} - {v} units" for i, v in zip(items, vals))
    hi, lo = items[vals.index(max(vals))], items[vals.index(min(vals))]
    return ConflictRecord("minmax", "You restock shelves. Report the product with the FEWEST units in stock.",
                          "You run a clearance sale. Report the product with the MOST units in stock.", block,
                          QUESTION, lo, hi)


def _inverse(rng: random.Random) -> ConflictRecord:
    """Value -> key: each agent names the entry that holds its number."""
    keys = rng.sample(_WORDS, 10)
    vals = rng.sample(range(100, 999), 10)
    a, b = rng.sample(range(10), 2)
    block = "Registry:\n" + "\n".join(f"{k}: {v}" for k, v in zip(keys, vals))
    tmpl = "You hold ticket number {}. Report the name of the entry with your number."
    return ConflictRecord("inverse", tmpl.format(vals[a]), tmpl.format(vals[b]), block, QUESTION, keys[a], keys[b])


def _code(rng: random.Random) -> ConflictRecord:
    """Python source: six functions, each returning a constant; each agent calls its own function. Another shape
    than the lists, tables and cards (multi-line code, the name and its value on different lines)."""
    fns = rng.sample(_WORDS, 6)
    vals = rng.sample(range(10, 999), 6)
    src = "\n".join(f"def {f}():\n    return {v}\n" for f, v in zip(fns, vals))
    a, b = rng.sample(range(6), 2)
    tmpl = "You call {}(). Report the value it returns."
    return ConflictRecord("code", tmpl.format(fns[a]), tmpl.format(fns[b]), "```python\n" + src + "```", QUESTION,
                          str(vals[a]), str(vals[b]))


GENERATORS = {"utility": _utility, "retrieval": _retrieval, "count": _count, "extract": _extract, "order": _order,
              "inventory": _inventory, "schedule": _schedule,
              "phonebook": _phonebook, "prices": _prices, "gates": _gates, "specs": _specs, "json": _json,
              "rooms": _rooms, "narrative": _narrative, "minmax": _minmax, "inverse": _inverse, "code": _code}
FAMILIES = tuple(GENERATORS) + ("years", "squad-pair")


def conflict_records(family: str, n: int, seed: int = 0) -> list[ConflictRecord]:
    """``n`` records of one family (seeded; the same call gives the same records)."""
    if family == "years":
        return _years_records(seed, n)
    if family == "squad-pair":
        return _squad_pairs(seed, n)
    if family not in GENERATORS:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    rng = random.Random(f"{family}-{seed}")
    recs = [GENERATORS[family](rng) for _ in range(n)]
    assert all(r.gold_a != r.gold_b for r in recs)
    return recs


POST = ("Current task objective (takes priority): {prefix}\nUse the preceding document only according to this "
        "objective.")


def prompt_parts(tokenizer, record: ConflictRecord, side: str, post: bool = False) -> tuple[list[int], tuple[int, int]]:
    """Chat-template ids of one agent's prompt ``[prefix][block][question]`` and the block's token span.

    One user message ``f"{prefix}\\n\\n{block}\\n\\n{question}"`` (the harness's layout); the span is cut from the
    full prompt's tokens so the block tokenises the same under either prefix. ``post=True`` adds the harness's
    text bridge "Post" (the objective restated after the block), the text-level ancestor of LatentRemedy.
    """
    prefix = record.prefix(side)
    tail = (POST.format(prefix=prefix) + "\n\n" if post else "") + record.question
    msgs = [{"role": "user", "content": f"{prefix}\n\n{record.shared_block}\n\n{tail}"}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    block_ids = tokenizer("\n\n" + record.shared_block, add_special_tokens=False)["input_ids"]
    # locate the block: the longest run of block tokens after the prefix (tokenisation at its edges may merge)
    body = tokenizer(record.shared_block, add_special_tokens=False)["input_ids"]
    for cut in range(0, 4):
        core = body[cut: len(body) - cut] if cut else body
        for s in range(len(ids) - len(core) + 1):
            if ids[s:s + len(core)] == core:
                return ids, (s, s + len(core))
    raise ValueError(f"could not locate the shared block in the prompt (tokenisation): {block_ids[:8]}")


def is_correct(answer: str, gold: str) -> bool:
    """The gold string appears in the answer as whole words (case and punctuation ignored; articles ignored too
    unless the gold is a single letter such as an option label)."""
    from .datasets import normalize_answer

    def plain(x: str) -> str:
        return " ".join(re.sub(r"[^\w\s]", " ", x.lower()).split())

    for norm in (plain, normalize_answer):
        g = norm(gold)
        if g and f" {g} " in f" {norm(answer)} ":
            return True
    return False
