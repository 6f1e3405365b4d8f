"""``hf-kvreuse bench``: workflows x methods x context sizes on offline data, side by side in one run.

For every question (SQuAD, offline), every workflow shape and every context size, the workflow runs once per
method, back to back, each through a fresh :class:`~hf_kvreuse.ReuseSession`; ``full`` (plain prefill) always
runs first and is the reference. Per method it reports:

* time: median TTFT per agent call and its ratio to full prefill's on the same call; end-to-end time (the
  workflow's summed generate time) and its ratio; with ``--floor``, TTFT over the floor (prefill of the prompt
  tokens no held cache has, plus one decode step, on an exact cache);
* quality: agreement of the final answer with the full-prefill workflow's (always), judge consistency for the
  ``judge`` shape, and task accuracy (a gold answer in the final answer), each with a 95% Wilson interval.

Writes ``bench.json`` (every call), ``bench.csv`` (the summary) and three plots (TTFT per method, accuracy vs
TTFT, per-agent timelines of the first question). ``bench.json`` is rewritten (atomically) after every question
with what was measured so far and ``"complete": false``, so a stopped run keeps its records; the last write says
``"complete": true``. Example::

    hf-kvreuse bench --model qwen2.5-0.5b --workflows fully_connected --methods full,prefix,auto,blend --n 50
    hf-kvreuse bench --model path/to/any/model_folder --dtype bf16 --n 5      # a local transformers model
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from .models.loaders import MODEL_KEYS as MODELS
from .workflows.datasets import QA_DATASETS


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def paired_difference(x: Sequence[bool], y: Sequence[bool], z: float = 1.96) -> tuple[float, float, float]:
    """Difference of two proportions measured on the same items, ``mean(x) - mean(y)``, with its 95% interval by
    Newcombe's method 10 ("Improved confidence intervals for the difference between binomial proportions based on
    paired data", Stat. Med. 1998): each proportion's Wilson interval, combined through the correlation ``phi`` of
    the pairs. Pairing matters: two methods that fail on the same items differ less than their marginal intervals
    suggest."""
    if len(x) != len(y):
        raise ValueError(f"paired_difference: {len(x)} and {len(y)} outcomes; pairs need the same items")
    n = len(x)
    if n == 0:
        return (float("nan"), float("nan"), float("nan"))
    a = sum(bool(u) and bool(v) for u, v in zip(x, y))
    b = sum(bool(u) and not v for u, v in zip(x, y))
    c = sum(not u and bool(v) for u, v in zip(x, y))
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson(a + b, n, z), wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den else 0.0
    diff = p1 - p2
    lo = diff - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = diff + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return (diff, max(-1.0, lo), min(1.0, hi))


def load(name: str, dtype: str):
    """``(model, tokenizer)`` of an offline model key or a local model folder; the workflows need a chat template."""
    from .models import load_by_key

    model, tok = load_by_key(name, dtype)
    if getattr(tok, "chat_template", None) is None:
        raise SystemExit(f"--model {name}: its tokenizer has no chat template; the bench's workflows are chats "
                         "(use an instruct / chat model, or add tokenizer_config.json's chat_template)")
    return model, tok


def questions(tok, n: int, context_tokens: int, seed: int = 0, dataset: str = "squad"):
    """``n`` questions of ``dataset`` (SQuAD, DROP or multi-turn CoQA) spread over the file, each with about
    ``context_tokens`` tokens of document (its passage among other passages of the set)."""
    from .workflows.datasets import context_for, qa_dataset

    items = qa_dataset(dataset)
    step = max(1, len(items) // n)
    picked = [items[(seed + i * step) % len(items)] for i in range(n)]
    return [(context_for(items, it, tok, context_tokens), it) for it in picked]


def floor_for(model, turn_ids: torch.Tensor, new_tokens: int) -> float:
    """Floor of one call: the forward of its ``new_tokens`` (the last prompt token included) on an exact cache of
    the tokens before them (:func:`hf_kvreuse.timing.floor_seconds`)."""
    from transformers import DynamicCache

    from .compat import cache_kwargs
    from .timing import floor_seconds

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(turn_ids[:, :-1], use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return floor_seconds(model, turn_ids, cache, new_tokens)


def run(args, checkpoint=None) -> dict:
    """Every cell of the bench; ``checkpoint(result)`` is called with the partial result after every question."""
    from tqdm.auto import tqdm

    from .guard import DivergenceGuard
    from .session import ReuseSession
    from .workflows.datasets import contains_answer, normalize_answer
    from .workflows.graphs import run_workflow

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = load_reference(args) if getattr(args, "reference", None) else None
    model, tok = load(args.model, args.dtype)
    methods = ["full"] + [m for m in args.methods if m != "full"]
    records = []
    jobs = [(w, c) for w in args.workflows for c in args.context_tokens]
    data = {c: questions(tok, args.n, c, args.seed, getattr(args, "dataset", "squad")) for c in args.context_tokens}
    span = question_span(args)
    guards: dict = {}
    bar = tqdm(total=len(jobs) * len(span) * (len(methods) - bool(reference)), desc="bench", unit="workflow")
    for shape, ctx in jobs:
        for q in span:
            doc, item = data[ctx][q]
            for method in methods:
                if method == "full" and reference is not None:
                    records.append(dict(reference[(shape, ctx, q)], reference=args.reference))
                    continue
                extra = {"method_kwargs": {"tokenizer": tok}} if method.split(":")[0] == "focus" else {}
                if method == "fast":  # one guard for the whole run: a deployed workflow keeps its record
                    extra["guard"] = guards.setdefault(method, DivergenceGuard())
                session = ReuseSession.for_method(model, method, max_bytes=args.max_bytes, **extra)
                run_ = run_workflow(session, tok, doc, item.question, shape=shape, rounds=args.rounds,
                                    max_new_tokens=args.max_new_tokens)
                turns = [{k: v for k, v in t.__dict__.items() if k != "prompt_ids"} for t in run_.turns]
                for d in turns:
                    # the first draft's logits (verified drafts: the caller never receives it), beside ttft_s, the
                    # first token the caller receives
                    d["draft_ttft_s"] = d["stats"].get("draft_ttft_s")
                if args.floor and method.startswith("auto"):
                    for t, d in zip(run_.turns, turns):
                        s = d["stats"]
                        # the floor prefills what no held cache had: not the rows repair= recomputes
                        repaired = (s.get("cache_stats") or {}).get("repaired_tokens", 0)
                        d["floor_s"] = floor_for(model, t.prompt_ids, s["new_tokens"] - repaired)
                        d["ttft_over_floor"] = s["ttft_s"] / d["floor_s"]
                rec = dict(workflow=shape, context_tokens=ctx, question=q, method=method, final=run_.final,
                           correct=contains_answer(run_.final, item.answers), judge_choice=run_.judge_choice,
                           e2e_s=run_.e2e_s, turns=turns)
                records.append(rec)
                bar.update(1)
            ref = next(r for r in records[-len(methods):] if r["method"] == "full")
            mine = next((r for r in records[-len(methods):] if r["method"] != "full"), None)
            if reference is not None and mine is not None and \
                    mine["turns"][0]["prompt_tokens"] != ref["turns"][0]["prompt_tokens"]:
                raise SystemExit(f"--reference {args.reference}: question {q} is not the same prompt "
                                 f"({ref['turns'][0]['prompt_tokens']} vs {mine['turns'][0]['prompt_tokens']} tokens)")
            for r in records[-len(methods):]:
                r["agrees"] = normalize_answer(r["final"]) == normalize_answer(ref["final"])
                r["judge_agrees"] = r["judge_choice"] == ref["judge_choice"] if shape == "judge" else None
                r["e2e_ratio"] = r["e2e_s"] / ref["e2e_s"]
                for t, tf in zip(r["turns"], ref["turns"]):
                    t["ttft_ratio"] = t["stats"]["ttft_s"] / tf["stats"]["ttft_s"]
                    if t["draft_ttft_s"] is not None:
                        t["draft_ttft_ratio"] = t["draft_ttft_s"] / tf["stats"]["ttft_s"]
            if checkpoint is not None:  # bench.json rewritten: a stopped run keeps every finished question
                checkpoint(dict(config=vars(args), complete=False, summary=summarize(records, methods),
                                records=records))
    bar.close()
    return dict(config=vars(args), complete=True, summary=summarize(records, methods), records=records)


def question_span(args) -> range:
    """The questions this run does: ``--questions A:B`` of the ``--n`` that ``--seed`` picks (all by default).

    The pick depends on ``n`` (questions are spread over the file), so a run stopped part way is completed with the
    same ``--n``/``--seed`` and the remaining span, then joined with ``hf-kvreuse merge``."""
    spec = getattr(args, "questions", None)
    if not spec:
        return range(args.n)
    try:
        a, b = (x.strip() for x in spec.split(":"))
        span = range(int(a or 0), int(b) if b else args.n)
    except ValueError:
        raise SystemExit(f"--questions {spec!r}: expected A:B, e.g. 13:25") from None
    if not span or span.start < 0 or span.stop > args.n:
        raise SystemExit(f"--questions {spec!r}: not a non-empty part of the --n {args.n} questions (0:{args.n})")
    return span


REFERENCE_KEYS = ("model", "dtype", "rounds", "max_new_tokens", "seed", "n", "max_bytes", "dataset")
REFERENCE_DEFAULTS = {"dataset": "squad"}  # runs recorded before the option existed ran on SQuAD


def load_reference(args) -> dict:
    """Full-prefill records of an earlier ``bench.json`` of the same configuration, by (workflow, context, question).

    Full prefill is greedy and deterministic, so its answers can be reused; its timings were not measured side by
    side with this run (the JSON says so: ``config.reference``), and the run refuses a reference whose settings or
    questions differ (the same ``--seed`` picks the same questions; each question's first prompt is compared)."""
    ref = json.loads(Path(args.reference).read_text())
    configs, records = ref["config"], ref["records"]
    if isinstance(configs, list):  # a merged file: its runs of this seed and n, questions named "seed/n:index"
        name = f"{args.seed}/{args.n}:"
        configs = [c for c in configs if c.get("seed", 0) == args.seed and c.get("n") == args.n]
        if not configs:
            raise SystemExit(f"--reference {args.reference}: a merged file with no run of seed {args.seed}, n {args.n}")
        records = [dict(r, question=int(r["question"][len(name):])) for r in records
                   if isinstance(r["question"], str) and r["question"].startswith(name)]
    else:
        configs = [configs]
    for cfg in configs:
        bad = [k for k in REFERENCE_KEYS if cfg.get(k, REFERENCE_DEFAULTS.get(k)) != getattr(args, k, REFERENCE_DEFAULTS.get(k))]
        if bad:
            raise SystemExit(f"--reference {args.reference}: its {', '.join(bad)} differ from this run's "
                             f"({', '.join(f'{k}={cfg.get(k)!r}' for k in bad)})")
    out = {(r["workflow"], r["context_tokens"], r["question"]): r for r in records if r["method"] == "full"}
    missing = [(w, c, q) for w in args.workflows for c in args.context_tokens for q in question_span(args)
               if (w, c, q) not in out]
    if missing:
        raise SystemExit(f"--reference {args.reference} has no full-prefill record of {missing[:3]} ...")
    return out


def _ratios(turn: dict) -> tuple[float, float | None]:
    """(first token received, first draft) over full prefill's first token; records written before the draft had its
    own name kept the draft's ratio in ``ttft_ratio`` and the received one in ``first_verified_ratio``."""
    if "first_verified_ratio" in turn:
        return turn["first_verified_ratio"], turn["ttft_ratio"]
    return turn["ttft_ratio"], turn.get("draft_ttft_ratio")


def summarize(records: list[dict], methods: list[str]) -> list[dict]:
    med = statistics.median
    rows = []
    keys = sorted({(r["workflow"], r["context_tokens"]) for r in records})
    for shape, ctx in keys:
        for m in methods:
            rs = [r for r in records if r["workflow"] == shape and r["context_tokens"] == ctx and r["method"] == m]
            if not rs:
                continue
            n = len(rs)
            turns = [t for r in rs for t in r["turns"]]
            k_acc, k_agree = sum(r["correct"] for r in rs), sum(r["agrees"] for r in rs)
            row = dict(workflow=shape, context_tokens=ctx, method=m, n=n, calls=len(turns),
                       accuracy=k_acc / n, accuracy_ci=wilson(k_acc, n),
                       agreement=k_agree / n, agreement_ci=wilson(k_agree, n),
                       ttft_s=med(t["stats"]["ttft_s"] for t in turns),
                       ttft_ratio=med(_ratios(t)[0] for t in turns),
                       exact_output_share=sum(bool(t["stats"].get("exact_output", True)) for t in turns) / len(turns),
                       e2e_s=med(r["e2e_s"] for r in rs), e2e_ratio=med(r["e2e_ratio"] for r in rs),
                       exact_prefix_frac=sum(t["stats"]["exact_prefix_tokens"] for t in turns)
                       / sum(t["stats"]["prompt_tokens"] for t in turns),
                       donor_frac=sum(t["stats"]["donor_tokens"] for t in turns)
                       / sum(t["stats"]["prompt_tokens"] for t in turns))
            full = {r["question"]: r["correct"] for r in records if r["workflow"] == shape
                    and r["context_tokens"] == ctx and r["method"] == "full"}
            pairs = [(r["correct"], full[r["question"]]) for r in rs if r["question"] in full]
            if m != "full" and pairs:  # paired: the same questions under full prefill
                d, lo, hi = paired_difference([a for a, _ in pairs], [b for _, b in pairs])
                row.update(accuracy_minus_full=d, accuracy_minus_full_ci=(lo, hi))
            drafts = [(t["stats"]["cache_stats"] or {}) for t in turns if t["stats"].get("cache_stats")]
            kept = sum(c.get("accepted_tokens") or 0 for c in drafts)
            withdrawn = sum(c.get("rejected_tokens") or 0 for c in drafts)
            if kept + withdrawn:
                row["accepted_share"] = kept / (kept + withdrawn)
            if shape == "judge":
                k = sum(bool(r["judge_agrees"]) for r in rs)
                row.update(judge_consistency=k / n, judge_consistency_ci=wilson(k, n))
            drafted = [_ratios(t)[1] for t in turns if _ratios(t)[1] is not None]
            if drafted:
                row["draft_ttft_ratio"] = med(drafted)
            floors = [t["ttft_over_floor"] for t in turns if "ttft_over_floor" in t]
            if floors:
                row["ttft_over_floor"] = med(floors)
            rows.append(row)
    return rows


def write_json(result: dict, out: Path) -> None:
    """``out/bench.json``, replaced atomically (a reader or a stopped run never sees half a file)."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".bench.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / "bench.json")


def write(result: dict, out: Path) -> None:
    write_json(result, out)
    rows = result["summary"]
    cols = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v[0]:.3f}-{v[1]:.3f}" if isinstance(v, tuple) else v) for k, v in r.items()})
    try:
        plot(result, out)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    groups = sorted({(r["workflow"], r["context_tokens"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(groups) * len(methods) / 3, 3.6))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ys = [next((r["ttft_s"] for r in rows if (r["workflow"], r["context_tokens"]) == g and r["method"] == m),
                   float("nan")) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], ys, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{w}\n{c} tok" for w, c in groups])
    ax.set_ylabel("median TTFT per call (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for r in rows:
        lo, hi = r["accuracy_ci"]
        ax.errorbar(r["ttft_s"], r["accuracy"], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]], fmt="o",
                    capsize=3)
        ax.annotate(f"{r['method']} ({r['workflow']})", (r["ttft_s"], r["accuracy"]), fontsize=6)
    ax.set_xlabel("median TTFT per call (s)")
    ax.set_ylabel("task accuracy (95% CI)")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_ttft.png", dpi=120)
    plt.close(fig)

    q0 = result["records"][0]["question"]  # the timeline draws the first question
    first = [r for r in result["records"] if r["question"] == q0]
    fig, axes = plt.subplots(len(first), 1, figsize=(7, 0.9 + 0.7 * len(first)), squeeze=False)
    for ax, r in zip(axes[:, 0], first):
        t = 0.0
        for turn in r["turns"]:
            ttft = turn["stats"]["ttft_s"] or 0.0
            ax.barh(0, ttft, left=t, color="tab:red")
            ax.barh(0, turn["wall_s"] - ttft, left=t + ttft, color="tab:blue")
            ax.text(t, 0.45, turn["agent"][:6], fontsize=5)
            t += turn["wall_s"]
        ax.set_yticks([])
        ax.set_ylabel(f"{r['method']}\n{r['workflow'][:8]}", rotation=0, ha="right", fontsize=6)
    axes[-1, 0].set_xlabel("seconds (red: to first token, blue: decoding)")
    fig.tight_layout()
    fig.savefig(out / "timelines.png", dpi=120)
    plt.close(fig)


#: the summary table's columns (``hf-kvreuse bench --help`` and docs/defaults.md print this text)
COLUMNS = {
    "workflow": "workflow shape",
    "ctx": "document size in tokens (--context-tokens)",
    "method": "session policy or named mode (--methods)",
    "n": "questions",
    "acc": "share of final answers that contain a gold answer",
    "agree": "share of final answers equal to full prefill's (normalised text)",
    "exact": "share of calls whose answer is guaranteed equal to plain generate's (stats.exact_output)",
    "TTFT s": "median time to the first token the caller receives, per agent call",
    "TTFTx": "median per-call ratio of that first token to full prefill's on the same call (< 1: earlier)",
    "draftx": "median per-call ratio of the first draft's logits (never received under verified drafts) to full "
              "prefill's first token; '-' without drafts",
    "e2e x": "median ratio of the workflow's summed generate time to full prefill's",
    "kept": "share of drafts kept by verification; '-' without verified drafts",
    "/floor": "with --floor: median first token over the floor (prefill of the call's new tokens on an exact cache)",
}


def print_summary(rows: list[dict]) -> None:
    head = f"{'workflow':16} {'ctx':>5} {'method':18} {'n':>3} {'acc':>5} {'agree':>6} {'exact':>5} {'TTFT s':>7} " \
           f"{'TTFTx':>6} {'draftx':>6} {'e2e x':>6} {'kept':>5} {'/floor':>6}"
    print(head)
    for r in rows:
        fl = f"{r['ttft_over_floor']:.2f}" if "ttft_over_floor" in r else "-"
        kept = f"{r['accepted_share']:.2f}" if "accepted_share" in r else "-"
        draft = f"{r['draft_ttft_ratio']:.2f}" if r.get("draft_ttft_ratio") is not None else "-"
        exact = f"{r['exact_output_share']:.2f}" if "exact_output_share" in r else "-"
        print(f"{r['workflow']:16} {r['context_tokens']:>5} {r['method']:18} {r['n']:>3} {r['accuracy']:>5.2f} "
              f"{r['agreement']:>6.2f} {exact:>5} {r['ttft_s']:>7.3f} {r['ttft_ratio']:>6.2f} "
              f"{draft:>6} {r['e2e_ratio']:>6.2f} {kept:>5} {fl:>6}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults printed as the values they are (a list as its comma-separated items); an option whose default
    depends on others (None) says so in its own text."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool) \
                or not action.option_strings:
            return action.help
        value = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        return f"{action.help} (default: {value})".replace("%", "%%")


MERGE_KEYS = ("model", "dtype", "rounds", "max_new_tokens", "max_bytes")


def merge(paths: list[str], out: Path) -> dict:
    """Join runs of one configuration: over different questions (``--seed`` shards, ``--questions`` spans run in
    parallel or after a stop) and over different methods of the same questions (a ``--reference`` run).

    A question is named by the ``--seed``/``--n`` that picked it and its index, so the same question from two runs is
    one question; a full-prefill record a ``--reference`` run copied is dropped when its original is merged too.
    Runs of other settings (model, dtype, rounds, tokens, byte budget) and a method measured twice on one question
    are refused."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    configs = [c for r in runs for c in (r["config"] if isinstance(r["config"], list) else [r["config"]])]
    for k in MERGE_KEYS:
        vals = {json.dumps(c.get(k)) for c in configs}
        if len(vals) > 1:
            raise SystemExit(f"merge: the runs differ in {k} ({', '.join(sorted(vals))}): not one configuration")
    seen: dict[tuple, dict] = {}
    methods: list[str] = []
    for path, r in zip(paths, runs):
        cfg = r["config"]
        for rec in r["records"]:
            q = rec["question"]
            if not isinstance(cfg, list):  # a merged file's questions are already named
                q = f"{cfg.get('seed', 0)}/{cfg.get('n')}:{q}"
            rec = dict(rec, question=q)
            key = (rec["workflow"], rec["context_tokens"], q, rec["method"])
            old = seen.get(key)
            if old is not None:
                if rec["method"] == "full" and (rec.get("reference") or old.get("reference")):
                    if old.get("reference"):
                        seen[key] = rec  # keep the run that measured it
                    continue
                raise SystemExit(f"merge: {rec['method']} on question {q} ({rec['workflow']}, "
                                 f"{rec['context_tokens']} tokens) is in two runs (the second: {path})")
            seen[key] = rec
            if rec["method"] not in methods:
                methods.append(rec["method"])
    records = list(seen.values())
    methods = ["full"] + [m for m in methods if m != "full"] if "full" in methods else methods
    result = dict(config=configs, merged_from=list(paths), summary=summarize(records, methods), records=records)
    write(result, out)
    return result


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def _model_arg(value: str) -> str:
    if value in MODELS or Path(value).is_dir():
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither one of {', '.join(MODELS)} nor a folder")


class _ColumnsFormatter(_HelpFormatter):
    """Keeps the epilog's one-line-per-column layout."""

    def _fill_text(self, text, width, indent):
        return "".join(indent + line for line in text.splitlines(keepends=True))


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-kvreuse`` argument parser (every option has its help text: ``hf-kvreuse bench --help``)."""
    from .session import MODES
    from .workflows.graphs import SHAPES

    runnable = [p for p in MODES if p not in ("translated", "base_lr")]
    p = argparse.ArgumentParser(prog="hf-kvreuse", description="hf_kvreuse command line: benchmark ReuseSession "
                                "policies on multi-agent workflows over SQuAD documents, and merge runs.",
                                formatter_class=_HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    columns = "\n".join(f"  {k:9} {v}" for k, v in COLUMNS.items())
    b = sub.add_parser("bench", formatter_class=_ColumnsFormatter,
                       epilog=f"summary columns (also in bench.csv / bench.json summary):\n{columns}",
                       help="workflows x methods x context sizes, side by side in one run",
                       description="Run every workflow shape x context size x question once per method, each "
                       "through a fresh ReuseSession, full prefill first (the reference). Writes OUT/bench.json "
                       "after every question (a stopped run keeps what it measured), then bench.csv and plots.")
    b.add_argument("--model", default="smollm2", type=_model_arg, metavar="MODEL",
                   help=f"an offline model ({', '.join(MODELS)}), or a local transformers model folder "
                   "(config.json, weights and a tokenizer with a chat template, as save_pretrained writes)")
    b.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32", "auto"),
                   help="weights and K/V dtype; default: fp32 for smollm2, bf16 for the Qwen models, 'auto' (the "
                   "dtype its config records) for a folder")
    b.add_argument("--workflows", type=_csv(str), default=["fully_connected"], metavar="SHAPES",
                   help=f"comma-separated workflow shapes: {', '.join(SHAPES)}")
    b.add_argument("--methods", type=_csv(str), default=["full", "prefix", "auto"], metavar="METHODS",
                   help=f"comma-separated session policies or named modes ({', '.join(runnable)}; "
                   "hf_kvreuse.session.MODES), each optionally with cache options for an ablation, "
                   "e.g. auto-verify:max_optimistic_tokens=4 (the whole spec names its records); full always "
                   "runs first")
    b.add_argument("--dataset", default="squad", choices=QA_DATASETS,
                   help="the questions and documents: SQuAD, DROP, or CoQA turns with the conversation before them")
    b.add_argument("--context-tokens", type=_csv(int), default=[1000], metavar="N[,N...]",
                   help="document sizes in tokens (the question's passage among other passages, about this size)")
    b.add_argument("--n", type=int, default=5, help="questions per cell")
    b.add_argument("--rounds", type=int, default=3, help="rounds of the round-based shapes (fully_connected, debate)")
    b.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per agent call (greedy)")
    b.add_argument("--max-bytes", type=int, default=2 << 30, help="K/V bytes each ReuseSession may hold")
    b.add_argument("--floor", action="store_true",
                   help="also time each auto call's floor: prefill of its new tokens on an exact cache (slower)")
    b.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    b.add_argument("--seed", type=int, default=0, help="offset of the first question in the dataset's file (shards)")
    b.add_argument("--out", default="bench_results", help="output folder (bench.json, bench.csv, plots)")
    b.add_argument("--questions", default=None, metavar="A:B",
                   help="run only questions A..B-1 of the --n picked (complete a stopped run; join with merge); "
                   "default: all of them")
    b.add_argument("--reference", default=None,
                   help="bench.json of an earlier run of the same settings: its full-prefill records are reused "
                        "instead of running full again (answers exact; its timings not side by side); default: "
                        "full prefill runs in this run")
    mg = sub.add_parser("merge", formatter_class=_HelpFormatter,
                        help="join bench.json files of one configuration run over different questions",
                        description="Join bench.json files of one configuration run over different questions "
                        "(e.g. --seed shards run in parallel) into one summary.")
    mg.add_argument("files", nargs="+", help="bench.json files to join")
    mg.add_argument("--out", required=True, help="output folder of the merged bench.json, bench.csv and plots")
    return p


def main(argv: list[str] | None = None) -> int:
    from .session import MODES, resolve_mode
    from .workflows.graphs import SHAPES

    args = build_parser().parse_args(argv)
    if args.command == "merge":
        print_summary(merge(args.files, Path(args.out))["summary"])
        return 0
    for m in args.methods:
        try:
            resolve_mode(m)
        except ValueError as e:
            raise SystemExit(f"--methods: {e}") from None
        if m.split(":")[0] in ("translated", "base_lr"):
            runnable = [p for p in MODES if p not in ("translated", "base_lr")]
            raise SystemExit(f"--methods: {m!r} is not a session policy the bench can run ({runnable}; translated "
                             "needs a source model and a map, base_lr a peft model)")
    for w in args.workflows:
        if w not in SHAPES:
            raise SystemExit(f"--workflows: {w!r} is not one of {SHAPES}")
    question_span(args)  # a bad --questions is refused before any model loads
    if args.dtype is None:
        args.dtype = "fp32" if args.model == "smollm2" else "bf16" if args.model in MODELS else "auto"
    out = Path(args.out)
    t0 = time.perf_counter()
    result = run(args, checkpoint=lambda partial: write_json(dict(partial, wall_s=time.perf_counter() - t0), out))
    result["wall_s"] = time.perf_counter() - t0
    result["git_commit"] = _git_commit()
    write(result, out)
    print_summary(result["summary"])
    print(f"wrote {args.out}/bench.json, bench.csv, ttft.png, accuracy_vs_ttft.png, timelines.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
