"""OptimisticCache vs full prefill on 3-agent chains over SQuAD documents (SmolLM2-135M-Instruct, CPU).

For every (shared context length, agent-specific role length) and repetition, a chain of agents
(researcher -> critic -> writer) runs on one SQuAD document of about `--contexts` tokens. The chain content is
fixed by full prefill (each agent sees the earlier agents' full-prefill answers); for every transition, the
next agent is run side by side, in alternating order, with

* full prefill: ``model.generate(ids)``;
* OptimisticCache: donor = the previous agent's cache and tokens;
* the floor: prefill of the tokens OptimisticCache had to compute (its ``new_tokens``) on top of an exact cache
  of the rest, plus one decode step.

TTFT and end-to-end times come from a streamer that timestamps every token (same for both methods); every run
generates exactly ``--max-new-tokens`` tokens (EOS is suppressed) so end-to-end times compare the same work.
Ratios are taken per transition, then the median over transitions is reported. Each run's peak memory growth
(hf_kvreuse.timing.PeakMemory: resident memory above the level before ``generate``) is reported beside full
prefill's. Writes JSON and a PNG plot.

    python benchmarks/optimistic.py [--contexts 512 1024 2048] [--role-tokens 32 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_kvreuse
from hf_kvreuse import OptimisticCache
from hf_kvreuse.compat import output_cache
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.timing import PeakMemory, TokenTimer
from hf_kvreuse.workflows.agents import DEFAULT_AGENTS, agent_prompt
from hf_kvreuse.workflows.datasets import contains_answer, context_for, squad

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import MEMORY_COLUMNS, TIMING_COLUMNS, floor_seconds, markdown_table, summarize  # noqa: E402


MEASURE_MEMORY = True


def _memory(device):
    """PeakMemory, or a stand-in when timing runs alone: the sampler thread takes the GIL every few ms, which
    slows the Python-heavy assembly inside OptimisticCache's TTFT but not the floor (measured without it)."""
    if MEASURE_MEMORY:
        return PeakMemory(device, interval_s=0.004)
    import types
    from contextlib import nullcontext

    return nullcontext(types.SimpleNamespace(peak_mib=float("nan")))


def run_full(model, ids, gen):
    with _memory(ids.device) as mem:
        timer = TokenTimer().start()
        out = model.generate(ids, streamer=timer, return_dict_in_generate=True, **gen)
    timer.mem_mib = mem.peak_mib
    return out, timer


def run_optimistic(model, ids, donor, gen, max_optimistic_tokens, release_donor=False):
    cache = OptimisticCache(model, input_ids=ids, donor_cache=output_cache(donor), donor_ids=donor.sequences,
                            max_optimistic_tokens=max_optimistic_tokens, release_donor=release_donor, rebase="commit")
    with _memory(ids.device) as mem:
        timer = TokenTimer().start()
        out = model.generate(ids, cache=cache, streamer=timer, **gen)
    timer.mem_mib = mem.peak_mib
    return out, timer, cache.stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--role-tokens", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--reps", type=int, default=5, help="chains per setting (each gives 2 transitions)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-optimistic-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--release-donor", action="store_true",
                    help="OptimisticCache(release_donor=True): the donor (never used again here) is freed while the "
                         "optimistic cache is assembled")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "optimistic.json")
    ap.add_argument("--replot", action="store_true", help="only redraw the table and plot from --out")
    ap.add_argument("--no-memory", action="store_true",
                    help="time without the memory sampler (its thread competes for the GIL with the assembly)")
    args = ap.parse_args()
    global MEASURE_MEMORY
    MEASURE_MEMORY = not args.no_memory
    if args.replot:
        rows = json.loads(args.out.read_text())["rows"]
        print_table(rows)
        plot(rows, args.out.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)

    model, tok = load_smollm2()
    model = hf_kvreuse.enable(model)
    items = squad()
    # every run generates exactly max_new_tokens tokens, so end-to-end times compare the same work
    gen = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    model.generate(tok("warm up", return_tensors="pt")["input_ids"], max_new_tokens=4)

    rows = []
    for ctx in args.contexts:
        for role in args.role_tokens:
            samples = []
            for rep in range(args.reps):
                item = items[(rep * 97 + ctx) % len(items)]
                doc = context_for(items, item, tok, ctx)
                earlier = []
                ids = agent_prompt(tok, DEFAULT_AGENTS[0], doc, item.question, earlier, role)
                donor, _ = run_full(model, ids, gen)
                earlier.append((DEFAULT_AGENTS[0].name, tok.decode(donor.sequences[0, ids.shape[1]:],
                                                                   skip_special_tokens=True).strip()))
                for k, agent in enumerate(DEFAULT_AGENTS[1:], 1):
                    ids = agent_prompt(tok, agent, doc, item.question, earlier, role)
                    n = ids.shape[1]
                    if (rep + k) % 2:  # alternate the order: machines drift
                        full, tf = run_full(model, ids, gen)
                        opt, to, st = run_optimistic(model, ids, donor, gen, args.max_optimistic_tokens,
                                                      args.release_donor)
                    else:
                        opt, to, st = run_optimistic(model, ids, donor, gen, args.max_optimistic_tokens,
                                                      args.release_donor)
                        full, tf = run_full(model, ids, gen)
                    fl = floor_seconds(model, ids, output_cache(full), st.new_tokens)
                    full_text = tok.decode(full.sequences[0, n:], skip_special_tokens=True)
                    opt_text = tok.decode(opt[0, n:], skip_special_tokens=True)
                    s = dict(rep=rep, agent=agent.name, prompt_tokens=n, full_ttft=tf.ttft_s, full_e2e=tf.total_s,
                             opt_ttft=to.ttft_s, opt_e2e=to.total_s, floor=fl, full_mem_mib=tf.mem_mib,
                             opt_mem_mib=to.mem_mib, **st.as_dict(),
                             identical=bool(torch.equal(opt, full.sequences)),
                             first_token_agrees=bool(opt[0, n] == full.sequences[0, n]),
                             full_correct=contains_answer(full_text, item.answers),
                             opt_correct=contains_answer(opt_text, item.answers))
                    samples.append(s)
                    print(f"ctx {ctx} role {role} rep {rep} {agent.name:8s} N={n} full {tf.ttft_s:.3f}/{tf.total_s:.3f}s "
                          f"opt {to.ttft_s:.3f}/{to.total_s:.3f}s floor {fl:.3f}s new {st.new_tokens} "
                          f"swap@{st.swap_step} div {st.divergent_tokens} same={s['identical']} "
                          f"mem full {tf.mem_mib:.0f} / opt {to.mem_mib:.0f} MiB", flush=True)
                    earlier.append((agent.name, full_text.strip()))
                    donor = full
            row = dict(context_tokens=ctx, role_tokens=role, **summarize(samples),
                       first_token_agreement=sum(s["first_token_agrees"] for s in samples) / len(samples),
                       full_accuracy=sum(s["full_correct"] for s in samples) / len(samples),
                       opt_accuracy=sum(s["opt_correct"] for s in samples) / len(samples),
                       samples=samples)
            rows.append(row)

    meta = dict(command=" ".join([Path(sys.executable).name] + sys.argv), date=time.strftime("%Y-%m-%d %H:%M"),
                torch=torch.__version__, transformers=transformers.__version__, threads=args.threads,
                cpu=platform.processor() or platform.machine(), max_new_tokens=args.max_new_tokens,
                max_optimistic_tokens=args.max_optimistic_tokens, release_donor=args.release_donor)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print_table(rows)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def print_table(rows):
    columns = [("shared ctx", lambda r: str(r["context_tokens"])), ("role tok", lambda r: str(r["role_tokens"])),
               *TIMING_COLUMNS, *MEMORY_COLUMNS, ("divergent", lambda r: f"{r['divergent_tokens']:.0f}"),
               ("identical", lambda r: f"{r['identical_rate']:.0%}")]
    # no accuracy column: SmolLM2 cannot do the task (the JSON keeps it); accuracy: hf-kvreuse bench on Qwen
    print("\n" + markdown_table(rows, columns))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, role in enumerate(sorted({r["role_tokens"] for r in rows})):
        rr = [r for r in rows if r["role_tokens"] == role]
        x = [r["context_tokens"] for r in rr]
        c_full, c_opt = f"C{2 * i}", f"C{2 * i + 1}"
        axes[0].plot(x, [r["full_ttft_s"] for r in rr], "o-", color=c_full, label=f"full prefill (role {role})")
        axes[0].plot(x, [r["opt_ttft_s"] for r in rr], "s-", color=c_opt, label=f"OptimisticCache (role {role})")
        axes[0].plot(x, [r["floor_s"] for r in rr], ":", color=c_opt, label=f"floor: new tokens + 1 step (role {role})")
        axes[1].plot(x, [r["e2e_ratio"] for r in rr], "s-", color=c_opt, label=f"role {role}")
    axes[0].set(xscale="log", yscale="log", xlabel="shared context (tokens)", ylabel="TTFT (s, median)",
                title="Time to first token")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].axhline(1.15, color="red", lw=0.8, ls="--", label="target 1.15")
    axes[1].set(xscale="log", xlabel="shared context (tokens)", ylabel="E2E optimistic / full (median)",
                title="End-to-end time ratio")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
