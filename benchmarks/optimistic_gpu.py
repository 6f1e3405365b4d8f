"""OptimisticCache vs full prefill on an NVIDIA GPU, exact prefill on a side CUDA stream.

Random-init models built from configs (timing does not depend on the weights, and weights cannot be copied to
the GPU machine): SmolLM2-135M's shape and a Llama-3.2-1B / 3B shape, where prefill is compute-bound. Prompts
are random tokens: agent A = role_A ⊕ shared block, agent B = role_B ⊕ shared block ⊕ A's answer. For every
(model, shared length) the script runs, side by side and alternating, full prefill and OptimisticCache (donor =
A's cache), plus the floor prefill(new tokens) + one decode step, and first checks exactness in float32.
Peak memory growth of each generate (``torch.cuda.max_memory_allocated`` above the level before it, through
hf_kvreuse.timing.PeakMemory) is reported beside full prefill's.
Runs with torch 2.11 / transformers 5.17 and newer. Writes JSON after the checks and every repetition (a run cut
by a time limit keeps what it measured; ``complete`` turns true at the end).

    python benchmarks/optimistic_gpu.py                       # on a CUDA machine
    python benchmarks/optimistic_gpu.py --device cpu --preset tiny --reps 1    # smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_kvreuse
from hf_kvreuse import OptimisticCache
from hf_kvreuse.compat import cache_kwargs, output_cache
from hf_kvreuse.timing import PeakMemory, TokenTimer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (MEMORY_COLUMNS, TIMING_COLUMNS, floor_seconds, markdown_table, seconds, summarize,  # noqa: E402
                    write_json)

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, rope_theta=10000.0, tie_word_embeddings=False),
}
PRESETS = {
    "default": dict(models=["smollm2-135m", "llama-1b", "llama-3b"], contexts=[2048, 8192, 16384]),
    "tiny": dict(models=["tiny"], contexts=[256]),
}


def build(shape: str, device, dtype):
    cfg = LlamaConfig(max_position_embeddings=32768, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return hf_kvreuse.enable(model)


def prompts(vocab, shared, role, answer, device, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(10, vocab, (1, n), generator=g)  # noqa: E731
    block, ra, rb, ans = r(shared), r(role), r(role), r(answer)
    return torch.cat([ra, block], 1).to(device), torch.cat([rb, block, ans], 1).to(device), ans.to(device)


def donor_output(model, ids_a, answer):
    """Agent A's prefill + its 'answer' (teacher-forced, so B's prompt contains it)."""
    seq = torch.cat([ids_a, answer], 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(seq[:, :-1], use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return cache, seq


def check_exactness(device) -> dict:
    """float32 on the device: the three correctness gates of the library."""
    model = build("smollm2-135m" if device.type == "cuda" else "tiny", device, torch.float32)
    ids_a, ids_b, _ = prompts(model.config.vocab_size, 300, 24, 16, device, seed=1)
    donor, dids = donor_output(model, ids_a, ids_b[:, -16:])
    gen = dict(max_new_tokens=24, do_sample=False)
    ref = model.generate(ids_b, **gen)
    res = {}
    c = OptimisticCache(model, input_ids=ids_b, donor_cache=donor, donor_ids=dids, max_optimistic_tokens=0,
                        rebase="commit")
    res["zero_optimistic_equals_generate"] = bool(torch.equal(model.generate(ids_b, cache=c, **gen), ref))
    c = OptimisticCache(model, input_ids=ids_a, donor_cache=donor, donor_ids=dids, max_optimistic_tokens=None,
                        rebase="commit")
    res["self_donor_equals_generate"] = bool(torch.equal(model.generate(ids_a, cache=c, **gen),
                                                         model.generate(ids_a, **gen)))
    c = OptimisticCache(model, input_ids=ids_b, donor_cache=donor, donor_ids=dids, max_optimistic_tokens=8,
                        rebase="commit")
    out = model.generate(ids_b, cache=c, **gen)
    s = c.stats.swap_step
    cont = model.generate(out[:, : ids_b.shape[1] + s], max_new_tokens=24 - s, do_sample=False)
    res["after_swap_equals_generate"] = bool(torch.equal(out, cont))
    res["swap_step"] = s
    del model
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", choices=list(PRESETS), default="default")
    ap.add_argument("--models", nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--role-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-optimistic-tokens", type=int, default=None,
                    help="default None: swap as soon as the side stream is done")
    ap.add_argument("--background-start", default="auto", choices=["auto", "immediate", "after_first_token"])
    ap.add_argument("--background-chunk-tokens", type=int, default=None,
                    help="chunked background prefill: bounds its activations (measure the time it costs)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-checks", action="store_true", help="skip the float32 exactness checks (a second run)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "optimistic_gpu.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --preset tiny for a smoke run")
    dtype = getattr(torch, args.dtype)
    models = args.models or PRESETS[args.preset]["models"]
    contexts = args.contexts or PRESETS[args.preset]["contexts"]
    meta = dict(command=" ".join(["python"] + sys.argv), date=time.strftime("%Y-%m-%d %H:%M"),
                torch=torch.__version__, transformers=transformers.__version__, device=str(device),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, dtype=args.dtype,
                role_tokens=args.role_tokens, answer_tokens=args.answer_tokens, max_new_tokens=args.max_new_tokens,
                max_optimistic_tokens=args.max_optimistic_tokens, background_start=args.background_start,
                background_chunk_tokens=args.background_chunk_tokens)
    print(json.dumps(meta))
    # checkpoints: the JSON is rewritten after the checks and after every repetition (``complete`` turns true at
    # the end; ``in_progress`` holds the samples of an unfinished row), so a run cut by a time limit keeps them
    doc = dict(meta=meta, checks=None, rows=[], in_progress=None, complete=False)
    write_json(args.out, doc)
    checks = doc["checks"] = None if args.no_checks else check_exactness(device)
    write_json(args.out, doc)
    print("exactness checks (fp32):", checks, flush=True)

    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    rows = doc["rows"]
    for shape in models:
        model = build(shape, device, dtype)
        warm = prompts(model.config.vocab_size, 256, 16, 16, device, seed=0)[0]
        for _ in range(2):
            model.generate(warm, max_new_tokens=8, do_sample=False)
        for ctx in contexts:
            samples = []
            doc["in_progress"] = dict(model=shape, context_tokens=ctx, samples=samples)
            for rep in range(args.reps):
                ids_a, ids_b, ans = prompts(model.config.vocab_size, ctx, args.role_tokens, args.answer_tokens,
                                            device, seed=rep)
                donor, dids = donor_output(model, ids_a, ans)
                res = {}
                mem = {}
                for method in (("full", "opt") if rep % 2 == 0 else ("opt", "full")):
                    if method == "opt":
                        cache = OptimisticCache(model, input_ids=ids_b, donor_cache=donor, donor_ids=dids,
                                                max_optimistic_tokens=args.max_optimistic_tokens,
                                                background_start=args.background_start,
                                                background_chunk_tokens=args.background_chunk_tokens, rebase="commit")
                    with PeakMemory(device) as m:
                        timer = TokenTimer(device).start()
                        if method == "full":
                            out = model.generate(ids_b, streamer=timer, return_dict_in_generate=True, **gen)
                        else:
                            out = model.generate(ids_b, cache=cache, streamer=timer, **gen)
                    mem[method] = m.peak_mib
                    res[method] = (timer.ttft_s, timer.total_s, out) + ((cache.stats,) if method == "opt" else ())
                st = res["opt"][3]
                fl = floor_seconds(model, ids_b, output_cache(res["full"][2]), st.new_tokens)
                n = ids_b.shape[1]
                s = dict(full_ttft=res["full"][0], full_e2e=res["full"][1], opt_ttft=res["opt"][0],
                         opt_e2e=res["opt"][1], floor=fl, prompt_tokens=n, full_mem_mib=mem["full"],
                         opt_mem_mib=mem["opt"],
                         identical=bool(torch.equal(res["opt"][2], res["full"][2].sequences)), **st.as_dict())
                samples.append(s)
                write_json(args.out, doc)
                print(f"{shape} ctx {ctx} rep {rep}: full {s['full_ttft']*1e3:.1f}/{s['full_e2e']*1e3:.0f} ms, "
                      f"opt {s['opt_ttft']*1e3:.1f}/{s['opt_e2e']*1e3:.0f} ms, floor {fl*1e3:.1f} ms, "
                      f"swap@{st.swap_step}, bg {st.background_prefill_s and st.background_prefill_s*1e3:.0f} ms, "
                      f"mem full {mem['full']:.0f} / opt {mem['opt']:.0f} MiB",
                      flush=True)
            rows.append(dict(model=shape, context_tokens=ctx, **summarize(samples), samples=samples))
            doc["in_progress"] = None
            write_json(args.out, doc)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    doc["complete"] = True
    write_json(args.out, doc)
    ms = {"TTFT full": "full_ttft_s", "TTFT opt": "opt_ttft_s", "floor": "floor_s", "E2E full": "full_e2e_s",
          "E2E opt": "opt_e2e_s"}
    columns = [("model", lambda r: r["model"]), ("shared ctx", lambda r: str(r["context_tokens"]))] + [
        (h, seconds(ms[h], 1e3, "ms", 1) if h in ms else f) for h, f in TIMING_COLUMNS] + MEMORY_COLUMNS
    print("\n" + markdown_table(rows, columns))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
