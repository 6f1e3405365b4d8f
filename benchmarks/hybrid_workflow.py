"""A Qwen3.5-shaped linear-attention hybrid (three gated-delta-rule layers to one attention layer): ``ReuseSession``'s
default and its verified drafts (``policy="optimistic"``) against plain ``generate`` on a three-agent workflow, side
by side in one run.

No hybrid checkpoint ships offline, so the model is random-init (Qwen3.5's layer pattern and head layout at a size
this CPU runs; ``--hidden`` / ``--layers``); the gated-delta decay of every head is set by ``--decay`` (``init``: the
random init's, which forgets within a few tokens; ``0.02``: keeps ~40 tokens, so a draft's borrowed state matters
more). The figures say what the mechanism costs and keeps on this shape, not what a trained Qwen3.5 would accept.

The workflow: three agents over one document of ``--doc`` random tokens, ``--rounds`` rounds; every prompt carries
the transcript so far. Two layouts: ``role-first`` (``[role][document][transcript][cue]``: the document is not a
prefix of another agent's prompt, what drafts address) and ``doc-first`` (``[document][transcript][role][cue]``:
exact prefixes through held states). Each call runs, on the same prompt and one after the other, plain
``generate``, a ``ReuseSession()`` (the default, ``"auto"``) and a ``ReuseSession(policy="optimistic")``, each
session following the workflow. The first token the caller receives is timed by a streamer around each call (under
verified drafts, the first verified token). Every answer is checked against plain ``generate``'s (tokens, and
logits to 1e-3).

Writes ``OUT`` (JSON: config, commit, one row per call and policy, the summary; rewritten after every call) and a plot
beside it::

    PYTHONPATH=. python benchmarks/hybrid_workflow.py                 # both layouts, decays init and 0.02
    PYTHONPATH=. python benchmarks/hybrid_workflow.py --table         # print the table of the JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import git_commit, write_json  # noqa: E402

AGENTS = ("summarizer", "critic", "question writer")
POLICIES = ("auto", "optimistic")
LAYOUTS = ("role-first", "doc-first")


def hybrid(hidden: int, layers: int, decay: float | None, seed: int = 0, vocab: int = 8192):
    """A random-init Qwen3.5-shaped text model: ``layers`` layers, every fourth one full attention."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    heads = max(2, hidden // 64)
    cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                            head_dim=64, linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
                            linear_key_head_dim=64, linear_value_head_dim=64,
                            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                         for i in range(layers)], pad_token_id=0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # a decisive argmax, as the test zoo's models
        if decay is not None:
            for mod in model.modules():
                if hasattr(mod, "A_log"):
                    mod.A_log.fill_(float(torch.tensor(decay).log()))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _timed(fn, ids, **kw):
    from hf_kvreuse.timing import TokenTimer

    timer = TokenTimer().start()
    out = fn(ids, streamer=timer, **kw)
    return out, timer.ttft_s, timer.total_s


def run_workflow(model, args, layout: str, decay: str, rep: int, rows: list, save) -> None:
    from hf_kvreuse import ReuseSession

    g = torch.Generator().manual_seed(args.seed + rep)
    R = lambda k: torch.randint(3, model.config.vocab_size, (1, k), generator=g)  # noqa: E731
    doc = R(args.doc)
    roles = {a: R(24) for a in AGENTS}
    sessions = {p: ReuseSession(model, policy=p) for p in POLICIES}
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    transcript = torch.empty(1, 0, dtype=torch.long)
    for rnd in range(args.rounds):
        for agent in AGENTS:
            cue = R(8)
            parts = ([roles[agent], doc, transcript, cue] if layout == "role-first"
                     else [doc, transcript, roles[agent], cue])
            ids = torch.cat(parts, 1)
            ref, ref_ttft, ref_total = _timed(model.generate, ids, attention_mask=torch.ones_like(ids), **kw)
            for policy, session in sessions.items():
                out, ttft, total = _timed(session.generate, ids, agent=agent, **kw)
                st = session.last_stats
                same = bool(torch.equal(out.sequences, ref.sequences))
                diff = max(float((x - y).abs().max()) for x, y in zip(out.logits, ref.logits)) if same else None
                rows.append(dict(decay=decay, layout=layout, policy=policy, rep=rep, round=rnd, agent=agent,
                                 prompt_tokens=int(ids.shape[1]), plain_ttft_s=ref_ttft, ttft_s=ttft,
                                 ttft_ratio=ttft / ref_ttft, plain_total_s=ref_total, total_s=total,
                                 e2e_ratio=total / ref_total, same_tokens=same, max_logit_diff=diff, method=st.method,
                                 exact_prefix_tokens=st.exact_prefix_tokens, donor_tokens=st.donor_tokens,
                                 new_tokens=st.new_tokens, drafted_tokens=st.drafted_tokens,
                                 accepted_tokens=st.accepted_tokens, exact_output=bool(st.exact_output)))
                save()
                print(f"{decay:5s} {layout:10s} doc {rep} r{rnd} {agent:15s} {ids.shape[1]:5d} tok  plain {ref_ttft:6.3f}s  "
                      f"{policy:10s} {ttft:6.3f}s ({ttft / ref_ttft:4.2f}x) {st.method:10s} prefix "
                      f"{st.exact_prefix_tokens:5d} donor {st.donor_tokens:5d} drafts {st.accepted_tokens}/"
                      f"{st.drafted_tokens} same={same}", flush=True)
            transcript = torch.cat([transcript, ref.sequences[:, ids.shape[1]:]], 1)


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for decay in dict.fromkeys(r["decay"] for r in rows):
        for layout in LAYOUTS:
            for policy in POLICIES:
                sel = [r for r in rows if (r["decay"], r["layout"], r["policy"]) == (decay, layout, policy)]
                if not sel:
                    continue
                later = [r for r in sel if not (r["round"] == 0 and r["agent"] == AGENTS[0])] or sel  # a donor exists
                first_round = [r for r in later if r["round"] == 0]  # role-first: another agent's document only
                drafted = sum(r["drafted_tokens"] or 0 for r in sel)
                out.append(dict(
                    decay=decay, layout=layout, policy=policy, calls=len(sel),
                    ttft_ratio_median=statistics.median(r["ttft_ratio"] for r in later),
                    ttft_ratio_max=max(r["ttft_ratio"] for r in sel),
                    e2e_ratio_median=statistics.median(r["e2e_ratio"] for r in later),
                    first_round_ttft_ratio_median=(statistics.median(r["ttft_ratio"] for r in first_round)
                                                   if first_round else None),
                    same_tokens_share=sum(r["same_tokens"] for r in sel) / len(sel),
                    max_logit_diff=max((r["max_logit_diff"] or 0.0) for r in sel),
                    drafted_tokens=drafted, accepted_tokens=sum(r["accepted_tokens"] or 0 for r in sel),
                    acceptance=(sum(r["accepted_tokens"] or 0 for r in sel) / drafted) if drafted else None,
                    reused_tokens_median=statistics.median(r["exact_prefix_tokens"] + r["donor_tokens"] for r in later),
                    methods={m: sum(r["method"] == m for r in sel) for m in sorted({r["method"] for r in sel})}))
    return out


def table(doc: dict) -> str:
    a = doc["args"]
    lines = [f"Qwen3.5-shaped random-init hybrid: hidden {a['hidden']}, {a['layers']} layers (3 gated-delta : 1 "
             f"attention), {a['reps']} documents of {a['doc']} tokens, {a['rounds']} rounds x 3 agents, {a['max_new_tokens']} new "
             f"tokens, {a['threads']} threads", "",
             "| decay | layout | policy | first token / plain (median of calls with a donor; worst call) "
             "| round 1, agents 2-3 (median) | end to end / plain | answers = plain generate | max logit diff "
             "| drafts kept | reused tokens (median) | methods |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        acc = (f"{s['accepted_tokens']}/{s['drafted_tokens']} ({100 * s['acceptance']:.0f}%)"
               if s["acceptance"] is not None else "-")
        fr = s.get("first_round_ttft_ratio_median")
        lines.append(f"| {s['decay']} | {s['layout']} | {s['policy']} | {s['ttft_ratio_median']:.2f}x; "
                     f"{s['ttft_ratio_max']:.2f}x | {'-' if fr is None else f'{fr:.2f}x'} | {s['e2e_ratio_median']:.2f}x | {s['same_tokens_share']:.0%} | "
                     f"{s['max_logit_diff']:.1e} | {acc} | {s['reused_tokens_median']:.0f} | "
                     + ", ".join(f"{m} {n}" for m, n in s["methods"].items()) + " |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(d, lay) for d in dict.fromkeys(r["decay"] for r in doc["rows"]) for lay in LAYOUTS]
    groups = [g for g in groups if any((r["decay"], r["layout"]) == g for r in doc["rows"])]
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.2), squeeze=False)
    for ax, (decay, layout) in zip(axes[0], groups):
        for k, policy in enumerate(POLICIES):
            sel = [r for r in doc["rows"] if (r["decay"], r["layout"], r["policy"]) == (decay, layout, policy)]
            ax.plot(range(len(sel)), [r["ttft_ratio"] for r in sel], marker="o", label=policy)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"decay {decay}, {layout}", fontsize=9)
        ax.set_xlabel("call")
        ax.set_ylabel("first token / plain generate's")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--doc", type=int, default=2048, help="document tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="documents (fresh sessions each)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--decay", nargs="+", default=["init", "0.02"])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_workflow.json"))
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.out).read_text())))
        return 0
    torch.set_num_threads(a.threads)
    rows: list = []
    doc = dict(command="python benchmarks/hybrid_workflow.py " + " ".join(sys.argv[1:] if argv is None else argv),
               args=vars(a), git_commit=git_commit(ROOT), date=time.strftime("%F %T"),
               torch=torch.__version__, rows=rows, summary=[])

    def save():
        doc["summary"] = summary(rows)
        write_json(Path(a.out), doc)

    for decay in a.decay:
        model = hybrid(a.hidden, a.layers, None if decay == "init" else float(decay), seed=a.seed)
        ids = torch.randint(3, 100, (1, 64))
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)  # warm-up
        for rep in range(a.reps):
            for layout in a.layouts:
                run_workflow(model, a, layout, decay, rep, rows, save)
    save()
    plot(doc, Path(a.out).with_suffix(".png"))
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
