"""The library's methods side by side at real scale on one GPU: a 3-agent workflow, TTFT, first verified token,
end to end and peak memory, JSON rewritten after every row (a run cut by a time limit keeps what it measured).

Workflow: three agents share one document of ``context`` tokens behind different role prefixes; agent k's prompt
is ``role_k ⊕ document ⊕ answers of agents 1..k-1``. Agents 1 and 2 run plain ``generate`` (not timed); agent 3
is timed with every method, on the same prompt, alternating the order of full prefill:

``full``           plain ``generate`` (exact)
``prefix``         ``ReuseSession(policy="prefix")`` that served agents 1 and 2 (exact; the role prefixes differ,
                   so exact prefix caching finds little)
``optimistic-commit`` / ``optimistic-verify``
                   ``OptimisticCache`` from agent 2's cache (RebaseKV); verify's first verified token is the first
                   token guaranteed equal to full prefill's
``blend-0.15``, ``tail-16``, ``focus``
                   block reuse of the document computed standalone beforehand (approximate: no verified token)
``base_lr-prelrshared`` / ``base_lr-nonshared``
                   BaseLRCache over three turns of agents with their own random LoRA adapters (8B shape)
``translated-0.3`` TranslatedCache from a 0.5B-shaped source at recompute ratio 0.3 (map fitted on the device)

Models, most important first: ``llama3-8b`` (Llama-3-8B config, random init: timing does not depend on the
weights) and ``qwen2.5-1.5b`` (Qwen2.5-Coder-1.5B: real bf16 weights from ``--model-dir`` when the folder holds
them, written beforehand by ``scripts/convert_qwen_for_gpu.py``; random init of the same config otherwise,
recorded as ``weights: "random"``). Contexts 16k first, then 4k, then 32k.

    python benchmarks/real_scale_gpu.py --out results/real_scale.json [--model-dir assets/qwen2.5-coder-1.5b]
    python benchmarks/real_scale_gpu.py --tiny --device cpu --out /tmp/rs.json    # dry run anywhere (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import hf_kvreuse
from hf_kvreuse import (BaseLRCache, BlendCache, ChunkStore, FocusRecomputeCache, KVMapper, OptimisticCache,
                        ReuseSession, TailRecomputeCache, TranslatedCache)
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.timing import PeakMemory, TokenTimer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import write_json  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=40960,
                 tie_word_embeddings=False)
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                 tie_word_embeddings=True)
QWEN_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                 tie_word_embeddings=True)
TINY = dict(llama=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
            qwen=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
            qwen_src=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096))
BLOCK_METHODS = ("blend-0.15", "tail-16", "focus")
SESSION_METHODS = ("full", "prefix", "optimistic-commit", "optimistic-verify") + BLOCK_METHODS
ALL_METHODS = SESSION_METHODS + ("translated-0.3", "base_lr-prelrshared", "base_lr-nonshared")


class IdTokenizer:
    """A stand-in tokenizer (``batch_decode`` only) for random-init models without a tokenizer folder: every id
    is one word (what FocusRecomputeCache reads)."""

    def batch_decode(self, seqs, **kwargs):
        return [" ".join(f"w{int(i)}" for i in s) for s in seqs]


def random_model(cls, cfg_cls, shape, device, dtype):
    """A random-init ``cls`` built on ``device`` in ``dtype`` (``shape``: a dict of config fields, or a config)."""
    cfg = shape if not isinstance(shape, dict) else cfg_cls(**shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on the device: no float32 copy of an 8B model
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def load_target(name: str, args, device, dtype):
    """(model, tokenizer, weights) for ``name``; weights ``"real"`` or ``"random"``."""
    if args.tiny:
        cls, cfg = (LlamaForCausalLM, LlamaConfig) if name == "llama3-8b" else (Qwen2ForCausalLM, Qwen2Config)
        return random_model(cls, cfg, TINY["llama" if name == "llama3-8b" else "qwen"], device, dtype), None, \
            "random"
    if name == "llama3-8b":
        return random_model(LlamaForCausalLM, LlamaConfig, LLAMA3_8B, device, dtype), None, "random"
    tok = None
    folder = args.model_dir
    if folder is not None and (folder / "config.json").is_file():
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception:
            tok = None
        if any(folder.glob("*.safetensors")):
            from hf_kvreuse.models.loaders import load_local

            model, tok = load_local(folder, dtype, device)
            return model, tok, "real"
        from transformers import AutoConfig

        return random_model(Qwen2ForCausalLM, Qwen2Config, AutoConfig.from_pretrained(folder, local_files_only=True),
                            device, dtype), tok, "random"
    return random_model(Qwen2ForCausalLM, Qwen2Config, QWEN_1_5B, device, dtype), tok, "random"


def prepare(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return hf_kvreuse.enable(model)


def workflow(vocab: int, ctx: int, role: int, answer: int, device, seed: int = 0):
    """Agents' prompts: (ids_1, ids_2, ids_3), the document span in each, and the answers."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(10, vocab, (1, n), generator=g)  # noqa: E731
    doc, roles, answers = r(ctx), [r(role) for _ in range(3)], [r(answer) for _ in range(2)]
    ids = [torch.cat([roles[k], doc] + answers[:k], 1).to(device) for k in range(3)]
    return ids, (role, role + ctx), [a.to(device) for a in answers]


def run_agent(model, ids, answer):
    """An earlier agent: its prefill and its answer (teacher-forced), returning (cache, ids + answer)."""
    seq = torch.cat([ids, answer], 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(seq[:, :-1], use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return cache, seq


def timed(model, ids, device, gen, cache=None, session=None):
    """(out, ttft_s, e2e_s, peak_mib) of one generate."""
    with PeakMemory(device) as mem:
        timer = TokenTimer(device).start()
        if session is not None:
            out = session.generate(ids, streamer=timer, **gen)
        elif cache is not None:
            out = model.generate(ids, cache=cache, streamer=timer, **gen)
        else:
            out = model.generate(ids, streamer=timer, **gen)
    seq = out.sequences if hasattr(out, "sequences") else out
    return seq, timer.ttft_s, timer.total_s, mem.peak_mib


class Run:
    """The JSON document, rewritten after every row, and the time budget."""

    def __init__(self, out: Path, meta: dict, budget_s: float):
        self.out, self.deadline = out, time.perf_counter() + budget_s
        self.doc = dict(meta=meta, rows=[], errors=[], skipped=[], complete=False)
        write_json(out, self.doc)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def row(self, **r):
        self.doc["rows"].append(r)
        write_json(self.out, self.doc)
        ttft = r.get("ttft_s")
        print(f"{r['model']:>13} ctx {r['context_tokens']:>6} {r['method']:>20}: ttft "
              f"{'-' if ttft is None else f'{ttft * 1e3:.1f} ms'}, e2e {r.get('e2e_s', 0) * 1e3:.0f} ms, "
              f"peak {r.get('peak_mib', 0):.0f} MiB, identical {r.get('identical')}", flush=True)

    def error(self, where: dict, e: BaseException):
        self.doc["errors"].append(dict(where, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:]))
        write_json(self.out, self.doc)
        print(f"ERROR {where}: {type(e).__name__}: {e}", flush=True)


def session_methods(run: Run, model, tok, name: str, weights: str, ctx: int, args, device, methods):
    """Agent 3 of the workflow with every method in ``methods`` (of :data:`SESSION_METHODS`), full first."""
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    ids, span, answers = workflow(model.config.vocab_size, ctx, args.role_tokens, args.answer_tokens, device)
    c1, s1 = run_agent(model, ids[0], answers[0])
    c2, s2 = run_agent(model, ids[1], answers[1])
    del c1
    store = ChunkStore()
    if any(m in BLOCK_METHODS for m in methods):
        store.get_or_compute(model, ids[2][0, span[0]:span[1]])  # the document standalone, beforehand
    full = full_ttft = None
    base = dict(model=name, weights=weights, context_tokens=ctx, prompt_tokens=ids[2].shape[1])
    for method in methods:
        if run.left() < 0:
            run.doc["skipped"].append(dict(base, method=method, why="budget"))
            continue
        try:
            session = cache = None
            if method == "prefix":
                session = ReuseSession(model, policy="prefix")
                for i in (0, 1):
                    session.generate(ids[i], max_new_tokens=1, do_sample=False)
            elif method.startswith("optimistic"):
                cache = OptimisticCache(model, input_ids=ids[2], donor_cache=c2, donor_ids=s2,
                                        rebase=method.split("-")[1])
            elif method == "blend-0.15":
                cache = BlendCache(model, ids[2], [span], store=store, recompute_ratio=0.15)
            elif method == "tail-16":
                cache = TailRecomputeCache(model, ids[2], [span], store=store)
            elif method == "focus":
                cache = FocusRecomputeCache(model, ids[2], [span], tok or IdTokenizer(), store=store)
            seq, ttft, e2e, peak = timed(model, ids[2], device, gen, cache=cache, session=session)
            r = dict(base, method=method, ttft_s=ttft, e2e_s=e2e, peak_mib=peak)
            if method == "full":
                full, full_ttft = seq, ttft
                r.update(first_verified_s=ttft, exact=True)
            else:
                st = cache.stats if cache is not None else None
                exact = method == "prefix" or bool(getattr(st, "exact_output", False))
                # the first token the caller receives is a verified one on the exact paths (the streamer sees
                # verified tokens only); the first draft's time is the cache's draft_ttft_s
                fv = ttft if exact else None
                r.update(first_verified_s=fv, exact=exact, draft_ttft_s=getattr(st, "draft_ttft_s", None),
                         identical=None if full is None else
                         bool(torch.equal(seq.to(full.device), full)),
                         stats=st.as_dict() if st is not None and hasattr(st, "as_dict") else None)
                if full_ttft is not None and ttft:
                    r.update(full_ttft_s=full_ttft, ttft_speedup=full_ttft / ttft)
            run.row(**r)
        except Exception as e:  # one method failing never stops the others
            run.error(dict(base, method=method), e)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


def base_lr_methods(run: Run, model, name: str, weights: str, ctx: int, args, device):
    """BaseLRCache PreLRShared vs NonShared: three turns, agents with their own random LoRA (k/v projections)."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["k_proj", "v_proj"],
                                          init_lora_weights=False), adapter_name="a0")
    for a in ("a1", "a2"):
        pm.add_adapter(a, LoraConfig(r=16, lora_alpha=32, target_modules=["k_proj", "v_proj"],
                                     init_lora_weights=False))
    pm.to(device=device, dtype=next(model.parameters()).dtype).eval()
    g = torch.Generator().manual_seed(3)
    turns = [ctx] + [args.answer_tokens] * 2
    base = dict(model=name, weights=weights, context_tokens=ctx)
    try:
        for method in ("prelrshared", "nonshared"):
            if run.left() < 0:
                run.doc["skipped"].append(dict(base, method=f"base_lr-{method}", why="budget"))
                continue
            try:
                cache = BaseLRCache(pm, method=method)
                seq = torch.empty(1, 0, dtype=torch.long, device=device)
                for i, n in enumerate(turns):
                    seq = torch.cat([seq, torch.randint(10, model.config.vocab_size, (1, n), generator=g).to(device)],
                                    1)
                    pm.set_adapter(f"a{i}")
                    out, ttft, e2e, peak = timed(pm, seq, device, dict(max_new_tokens=args.max_new_tokens,
                                                                       do_sample=False), cache=cache)
                    seq = out
                run.row(**base, method=f"base_lr-{method}", ttft_s=ttft, e2e_s=e2e, peak_mib=peak, exact=False,
                        first_verified_s=None, turn=len(turns), prompt_tokens=seq.shape[1] - args.max_new_tokens)
            except Exception as e:
                run.error(dict(base, method=f"base_lr-{method}"), e)
    finally:
        pm.unload() if hasattr(pm, "unload") else None


def translated_method(run: Run, model, name: str, weights: str, ctx: int, args, device, dtype):
    """TranslatedCache from a 0.5B-shaped source (random init; map fitted on a few sequences on the device)."""
    shape = TINY["qwen_src"] if args.tiny else QWEN_0_5B
    src = prepare(random_model(Qwen2ForCausalLM, Qwen2Config, dict(shape, vocab_size=model.config.vocab_size),
                               device, dtype))
    base = dict(model=name, weights=weights, context_tokens=ctx)
    try:
        g = torch.Generator().manual_seed(4)
        calib = [torch.randint(10, model.config.vocab_size, (256 if not args.tiny else 48,), generator=g).to(device)
                 for _ in range(4)]
        mapper = KVMapper.fit(src, model, calib, stride=4, progress=False)
        ids = workflow(model.config.vocab_size, ctx, args.role_tokens, args.answer_tokens, device, seed=5)[0][2]
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        full, fttft, _, _ = timed(model, ids, device, gen)
        cache = TranslatedCache(model, src, mapper, ids, recompute_ratio=0.3)
        seq, ttft, e2e, peak = timed(model, ids, device, gen, cache=cache)
        run.row(**base, method="translated-0.3", ttft_s=ttft, e2e_s=e2e, peak_mib=peak, exact=False,
                first_verified_s=None, full_ttft_s=fttft, ttft_speedup=fttft / ttft if ttft else None,
                identical=bool(torch.equal(seq, full)), prompt_tokens=ids.shape[1])
    except Exception as e:
        run.error(dict(base, method="translated-0.3"), e)
    finally:
        del src


def plan(args) -> list[tuple[str, int, str]]:
    """(model, context, part) in the order they run: the figures that matter most first."""
    ctxs = args.contexts
    steps = [("llama3-8b", c, "session") for c in ctxs]
    steps += [("qwen2.5-1.5b", c, "session") for c in ctxs]
    steps += [("qwen2.5-1.5b", ctxs[0], "translated")]
    steps += [("llama3-8b", ctxs[0], "base_lr")]
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", "--dry-run", action="store_true", dest="tiny",
                    help="tiny random models and contexts: checks the whole script anywhere in seconds")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="Qwen2.5-Coder-1.5B folder written by scripts/convert_qwen_for_gpu.py")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 16384 4096 32768 (tiny: 64)")
    ap.add_argument("--methods", nargs="+", default=list(SESSION_METHODS), choices=list(SESSION_METHODS))
    ap.add_argument("--role-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new row after this many seconds")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpu" / "real_scale.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --tiny for a dry run")
    if args.tiny:
        args.contexts = args.contexts or [64]
        args.role_tokens, args.answer_tokens, args.max_new_tokens = 8, 6, 4
        dtype = torch.float32
    else:
        args.contexts = args.contexts or [16384, 4096, 32768]
        dtype = getattr(torch, args.dtype)
    meta = dict(command=" ".join(["python"] + sys.argv), date=time.strftime("%Y-%m-%d %H:%M"),
                torch=torch.__version__, transformers=transformers.__version__, device=str(device),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, dtype=str(dtype),
                tiny=args.tiny, contexts=args.contexts, methods=args.methods, role_tokens=args.role_tokens,
                answer_tokens=args.answer_tokens, max_new_tokens=args.max_new_tokens)
    print(json.dumps(meta), flush=True)
    run = Run(args.out, meta, args.budget_s)
    loaded = {}
    for name, ctx, part in plan(args):
        if run.left() < 0:
            run.doc["skipped"].append(dict(model=name, context_tokens=ctx, part=part, why="budget"))
            write_json(args.out, run.doc)
            continue
        try:
            if name not in loaded:
                for other in list(loaded):  # one model on the device at a time
                    del loaded[other]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                model, tok, weights = load_target(name, args, device, dtype)
                loaded[name] = (prepare(model), tok, weights)
                run.doc.setdefault("models", {})[name] = dict(weights=weights, config=model.config.to_diff_dict())
                model.generate(torch.randint(10, 100, (1, 64), device=device), max_new_tokens=4, do_sample=False)
            model, tok, weights = loaded[name]
            if part == "session":
                session_methods(run, model, tok, name, weights, ctx, args, device, args.methods)
            elif part == "translated":
                translated_method(run, model, name, weights, ctx, args, device, dtype)
            else:
                base_lr_methods(run, model, name, weights, ctx, args, device)
                del loaded[name]  # the LoRA wrapper changed it
        except Exception as e:
            run.error(dict(model=name, context_tokens=ctx, part=part), e)
    run.doc["complete"] = not run.doc["skipped"]
    write_json(args.out, run.doc)
    print(f"wrote {args.out}: {len(run.doc['rows'])} rows, {len(run.doc['errors'])} errors, "
          f"{len(run.doc['skipped'])} skipped")
    return run.doc


if __name__ == "__main__":
    main()
