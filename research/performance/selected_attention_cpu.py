"""CPU timing of the partial-recompute engine's attention for selected rows: one SDPA call with the boolean mask
(the layer-range path before), with the additive float mask (the whole-model path before), and the blocked
formulation (:func:`hf_kvreuse.triton.selected_attention.selected_attention_blocked`: SDPA per block of rows over
only the columns the block can see), each as the attention function of one layer sees it (``[B, H, R, D]`` in,
``[B, R, H, D]`` out; the old paths through transformers' ``sdpa_attention_forward``, so ``repeat_kv`` included).

Rows: ``--ratio`` of the first ``N - tail`` positions at random plus the last ``tail`` (CacheBlend's selection:
the picked reused rows and the question). Shape: SmolLM2-135M's (9 query heads, 3 KV heads, 64 dims).

    PYTHONPATH=. .venv/bin/python research/performance/selected_attention_cpu.py                       # attention per layer
    PYTHONPATH=. .venv/bin/python research/performance/selected_attention_cpu.py --engine --tokens 4096   # + a whole partial_forward

``--engine`` also times ``partial_forward(layers=range(2, 30))`` (CacheBlend's second pass) on a random-weight
model of SmolLM2-135M's configuration, old path (mask) vs new (blocked), and compares the K/V they write.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_kvreuse import kernels
from hf_kvreuse.generation import partial as partial_mod
from hf_kvreuse.triton.selected_attention import SelectedPositions

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Layer:  # what sdpa_attention_forward reads from the attention module
    num_key_value_groups = 3
    is_causal = True
    training = False


def rows_for(n: int, ratio: float, tail: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    body = n - tail
    picked = torch.randperm(body, generator=g)[: int(body * ratio)]
    return torch.sort(torch.cat([picked, torch.arange(body, n)])).values


def timed(fn, reps: int) -> float:
    return timed_all([fn], reps)[0]


def timed_all(fns, reps: int) -> list[float]:
    """Median seconds of each function, run in turn within every repetition (a shared machine's load drifts)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def attention_table(args) -> list[dict]:
    out_rows = []
    print("| dtype | N | R | bool mask (ms) | float mask (ms) | blocked (ms) | speed-up vs bool | vs float | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    layer = _Layer()
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for n in args.tokens:
            rows = rows_for(n, args.ratio, args.tail)
            R = rows.numel()
            g = torch.Generator().manual_seed(1)
            q = torch.randn(1, 9, R, 64, generator=g).to(dtype)
            k = torch.randn(1, 3, n, 64, generator=g).to(dtype)
            v = torch.randn(1, 3, n, 64, generator=g).to(dtype)
            pos = torch.arange(n)
            bmask = (pos[None, :] <= rows[:, None])[None, None]
            fmask = partial_mod.position_causal_mask(rows, pos, dtype)
            sel = SelectedPositions(rows, pos, cpu_block=args.block)
            sel.plan(q.device)  # built once per forward, shared by every layer

            def blocked():
                out = q.new_empty(1, R, 9, 64)
                kernels.selected_attention(q, k, v, sel, 0.125, out=out.transpose(1, 2))
                return out

            want = sdpa_attention_forward(layer, q, k, v, bmask, scaling=0.125)[0]
            diff = (blocked().float() - want.float()).abs().max().item()
            tb, tf, tn = timed_all([lambda: sdpa_attention_forward(layer, q, k, v, bmask, scaling=0.125),
                                    lambda: sdpa_attention_forward(layer, q, k, v, fmask, scaling=0.125),
                                    blocked], args.reps)
            print(f"| {dname} | {n} | {R} | {tb * 1e3:.1f} | {tf * 1e3:.1f} | {tn * 1e3:.1f} | {tb / tn:.2f}x | "
                  f"{tf / tn:.2f}x | {diff:.2g} |", flush=True)
            out_rows.append(dict(dtype=dname, tokens=n, rows=R, bool_mask_s=tb, float_mask_s=tf, blocked_s=tn,
                                 speedup_vs_bool=tb / tn, speedup_vs_float=tf / tn, max_abs_diff=diff))
            t_plan = timed(lambda: SelectedPositions(rows, pos, cpu_block=args.block).plan(q.device), args.reps)
            print(f"<!-- plan build (once per forward): {t_plan * 1e3:.2f} ms -->")
            out_rows[-1]["plan_build_s"] = t_plan
    return out_rows


def engine_table(args) -> list[dict]:
    import transformers

    from hf_kvreuse.generation import partial_forward

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384,
                                   rope_theta=100000.0, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    out_rows = []
    print("\n| dtype | N | R | partial_forward(layers=2..29), mask path (s) | blocked (s) | speed-up | "
          "max rel K/V diff |")
    print("|---|---|---|---|---|---|---|")
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
        for n in args.tokens:
            rows = rows_for(n, args.ratio, args.tail)
            ids = torch.randint(3, 49152, (1, n))
            kv0 = [(torch.randn(1, 3, n, 64).to(dtype), torch.randn(1, 3, n, 64).to(dtype)) for _ in range(30)]
            hidden = torch.randn(1, rows.numel(), 576).to(dtype)
            results = {}
            for path in ("mask", "blocked"):
                orig = partial_mod.selected_path
                partial_mod.selected_path = (lambda *a: "mask") if path == "mask" else orig
                try:
                    kv = [(k.clone(), v.clone()) for k, v in kv0]

                    def run():
                        partial_forward(model, ids, rows, kv, layers=range(2, 30), hidden_states=hidden)

                    results[path] = timed(run, max(1, args.reps // 3)), kv
                finally:
                    partial_mod.selected_path = orig
            err = max(((a - b).abs().max() / b.abs().max()).item()
                      for (ka, va), (kb, vb) in zip(results["blocked"][1], results["mask"][1])
                      for a, b in ((ka.float(), kb.float()), (va.float(), vb.float())))
            tm, tn = results["mask"][0], results["blocked"][0]
            print(f"| {dname} | {n} | {rows.numel()} | {tm:.2f} | {tn:.2f} | {tm / tn:.2f}x | {err:.2g} |", flush=True)
            out_rows.append(dict(dtype=dname, tokens=n, rows=rows.numel(), mask_path_s=tm, blocked_s=tn,
                                 speedup=tm / tn, max_rel_kv_diff=err))
    return out_rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--block", type=int, default=None,
                    help="rows per SDPA call of the blocked formulation (default: the library's choice)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--engine", action="store_true", help="also time a whole partial_forward (slower)")
    ap.add_argument("--engine-only", action="store_true", help="only the partial_forward timing")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "benchmarks" / "results" /
                    "selected_attention_cpu.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    result = dict(command=" ".join(["python"] + sys.argv), torch=torch.__version__, threads=torch.get_num_threads(),
                  load_avg_1min=os.getloadavg()[0], ratio=args.ratio, tail=args.tail)
    if not args.engine_only:
        result["attention"] = attention_table(args)
    if args.engine or args.engine_only:
        result["engine"] = engine_table(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
