"""Training data of LatentRemedy at scale: teacher and student constants of conflicting-task records, computed
with two forwards per record and kept on disk (safetensors + JSON shards), so every ablation reuses them.

For a record, each agent's full prompt ``[prefix][block][question]`` runs once (the agents' common leading tokens,
the chat template's system prompt, once for both): that forward is at the same time

* the **teacher** of that agent (its greedy answer, ``n_answer`` tokens, and the top-``k`` log-probs at each
  answer position),
* the agent's **own prefix** K/V and hidden states (rows before the block; causal, so the same as computing the
  prefix alone), and
* the **donor block** K/V for the other agent (the block computed under this agent's prefix).

The student of direction ``X -> Y`` is then Y's prefix K/V, X's block K/V moved by RoPE to Y's block position
(direct reuse, as :class:`~hf_kvreuse.cache_classes.direct.DirectReuseCache` assembles it), then latents +
question + teacher answer. :func:`example_from_parts` builds it; ``tests/test_latent_remedy.py`` checks it equals
:func:`hf_kvreuse.latent.train.make_example` (the cache's own assembly).

A shard also records, per direction, whether direct reuse already reproduces the teacher's answer (its argmax at
every supervised position, teacher-forced): the screen of which families direct reuse hurts.

    python -m hf_kvreuse.latent.data --model qwen2.5-0.5b --families inventory schedule --n 100 --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kv import KV

# the shared type and the shard files, importable from here as before
from .example import (READ_LAYERS, Example, load_examples, load_shard, pair_donors,  # noqa: F401
                      save_shard)


def _forward_from(model, ids: torch.Tensor, base, start: int):
    """Run ``ids[:, start:]`` after a cache ``base`` holding ``ids[:, :start]`` (a copy); output with hidden states."""
    import copy

    from transformers import DynamicCache

    from ..compat import cache_kwargs

    cache = copy.deepcopy(base) if base is not None else DynamicCache(config=model.config)
    pos = torch.arange(start, ids.shape[1])[None]
    out = model(ids[:, start:], position_ids=pos, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **cache_kwargs(cache))
    return out, cache


@torch.no_grad()
def teacher_side(model, ids: list[int], span: tuple[int, int], n_answer: int, top_k: int, base=None,
                 base_len: int = 0, base_hidden=None, read_layers=READ_LAYERS) -> dict:
    """One agent's full prompt: teacher answer + top-k log-probs, the prompt's K/V and the prefix's hidden states.

    ``base`` (a DynamicCache of ``ids[:base_len]``, with ``base_hidden`` its hidden states) skips the leading rows
    shared with the other agent."""
    from ..compat import cache_kwargs

    x = torch.tensor([ids])
    out, cache = _forward_from(model, x, base, base_len)
    n_layers = model.config.num_hidden_layers
    hs = out.hidden_states  # [emb, after layer 0, ..., after layer L-1 with the final norm]
    s = span[0]

    def layer_rows(layer: int) -> torch.Tensor:
        idx = n_layers if layer < 0 else layer + 1
        rows = hs[idx][0]
        if base_hidden is not None:
            rows = torch.cat([base_hidden[idx][0], rows], 0)
        return rows[:s]
    if layer_rows(-1).shape[0] != s:
        raise ValueError("the shared leading rows reach into the block")
    feats = torch.stack([layer_rows(layer) for layer in read_layers]).to(torch.float16)
    kv = [(k[..., : len(ids), :].to(torch.float16).clone(), v[..., : len(ids), :].to(torch.float16).clone())
          for k, v in ((layer.keys, layer.values) for layer in cache.layers)]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    logits, ans = [out.logits[0, -1].float()], []
    for i in range(n_answer):
        tok = int(logits[-1].argmax())
        ans.append(tok)
        if tok in eos or i == n_answer - 1:
            break
        step = model(torch.tensor([[tok]]), position_ids=torch.tensor([[len(ids) + i]]), use_cache=True,
                     **cache_kwargs(cache))
        logits.append(step.logits[0, -1].float())
    logp = torch.stack(logits).log_softmax(-1)
    top_logp, top_idx = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    top_logp = top_logp - top_logp.logsumexp(-1, keepdim=True)
    return {"ids": ids, "span": span, "kv": kv, "feats": feats, "answer": ans, "top_idx": top_idx,
            "top_logp": top_logp.to(torch.float16)}


def example_from_parts(shifter, tgt: dict, src: dict, read_layers=READ_LAYERS, dtype=torch.float32) -> Example:
    """The student of direction ``src -> tgt``: tgt's prefix K/V, src's block K/V RoPE-moved to tgt's block."""
    (s, e), (ds, de) = tgt["span"], src["span"]
    if tgt["ids"][s:e] != src["ids"][ds:de]:
        raise ValueError("the two agents' blocks tokenise differently")
    kv = []
    for (tk, tv), (sk, sv) in zip(tgt["kv"], src["kv"]):
        bk = shifter.shift(sk[..., ds:de, :].to(dtype), s - ds)
        kv.append((torch.cat([tk[..., :s, :].to(dtype), bk], -2), torch.cat([tv[..., :s, :], sv[..., ds:de, :]],
                                                                            -2).to(dtype)))
    ans = tgt["answer"]
    full = torch.tensor([tgt["ids"] + ans[:-1]])
    feats = tgt["feats"]
    return Example(kv=kv, h=feats[read_layers.index(-1), -1:].float(), e=e, tail_ids=full[:, e:],
                   first=len(tgt["ids"]) - 1 - e, top_idx=tgt["top_idx"], top_logp=tgt["top_logp"].float(), s=s,
                   feats=feats, read_layers=tuple(read_layers), ids=full, donor_feats=src["feats"])


@torch.no_grad()
def record_examples(model, tok, rec, n_answer: int = 6, top_k: int = 32, shifter=None,
                    read_layers=READ_LAYERS) -> tuple[list[Example], dict]:
    """Both directions of a record (a->b: b reuses a's block; b->a) and the record's teacher summary."""
    from ..rope import RopeShifter
    from ..workflows.conflicting import is_correct, prompt_parts

    shifter = shifter or RopeShifter(model)
    parts = {side: prompt_parts(tok, rec, side) for side in "ab"}
    ia, ib = parts["a"][0], parts["b"][0]
    lcp = 0
    while lcp < min(len(ia), len(ib)) and ia[lcp] == ib[lcp]:
        lcp += 1
    lcp = min(lcp, parts["a"][1][0], parts["b"][1][0]) - 1  # leave at least one own row before each block
    base_out, base = _forward_from(model, torch.tensor([ia[:lcp]]), None, 0) if lcp > 0 else (None, None)
    sides = {}
    for side in "ab":
        ids, span = parts[side]
        sides[side] = teacher_side(model, ids, span, n_answer, top_k, base, max(lcp, 0),
                                   base_out.hidden_states if base_out is not None else None, read_layers)
    exs, info = [], {"family": rec.family}
    for src, tgt in (("a", "b"), ("b", "a")):
        ex = example_from_parts(shifter, sides[tgt], sides[src], read_layers)
        ans_text = tok.decode(sides[tgt]["answer"], skip_special_tokens=True).strip()
        ex.meta = {"family": rec.family, "direction": f"{src}->{tgt}", "teacher": ans_text,
                   "full_ok": is_correct(ans_text, rec.gold(tgt)), "gold": rec.gold(tgt),
                   "other_gold": rec.gold(src)}
        exs.append(ex)
    return exs, info


def reuse_agreement(model, exs: list[Example]) -> list[bool]:
    """Direct reuse (no latents) reproduces the teacher's answer: argmax == teacher token at every position."""
    from .train import student_logits_batch

    with torch.no_grad():
        logits = student_logits_batch(model, None, exs)
    return [bool((lg.argmax(-1) == ex.top_idx[:, 0]).all()) for lg, ex in zip(logits, exs)]


def main(argv=None) -> None:
    from ..models import load_offline
    from ..rope import RopeShifter
    from ..workflows.conflicting import conflict_records

    p = argparse.ArgumentParser(prog="python -m hf_kvreuse.latent.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--families", nargs="+", required=True)
    p.add_argument("--n", type=int, default=100, help="records per family")
    p.add_argument("--seed", type=int, default=0, help="record seed (evaluation uses 1000)")
    p.add_argument("--shard", type=int, default=25, help="records per shard file")
    p.add_argument("--n-answer", type=int, default=6)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_offline(a.model, dtype=getattr(torch, a.dtype))
    shifter = RopeShifter(model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    screen_path = out / f"screen_seed{a.seed}.json"
    screen = json.loads(screen_path.read_text()) if screen_path.exists() else {}
    for fam in a.families:
        recs = conflict_records(fam, a.n, seed=a.seed)
        for start in range(0, a.n, a.shard):
            path = out / f"{fam}_{a.seed}-{start:05d}.json"
            if path.exists():  # resumable: a finished shard is kept
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            exs = []
            for r_i, rec in enumerate(recs[start:start + a.shard], start):
                pair, _ = record_examples(model, tok, rec, a.n_answer, a.top_k, shifter)
                for ex in pair:
                    ex.meta["record"] = r_i
                exs.extend(pair)
            agree = reuse_agreement(model, exs)
            for ex, ag in zip(exs, agree):
                ex.meta["reuse_agree"] = ag
            save_shard(path, exs)
            rows = screen.setdefault(fam, [])
            rows.extend({"record": ex.meta["record"], "direction": ex.meta["direction"], "full_ok": ex.meta["full_ok"],
                         "reuse_agree": ex.meta["reuse_agree"], "teacher": ex.meta["teacher"]} for ex in exs)
            full = sum(r["full_ok"] for r in rows) / len(rows)
            kept = sum(r["full_ok"] and r["reuse_agree"] for r in rows) / len(rows)
            screen_path.write_text(json.dumps(screen, indent=0))
            print(f"{fam} {start + len(exs) // 2}/{a.n}: {time.perf_counter() - t0:.0f} s wall, "
                  f"{time.process_time() - c0:.0f} s CPU; full {100 * full:.0f}%, reuse keeps the answer "
                  f"{100 * kept:.0f}% -> drop {100 * (full - kept):.0f} pts (n={len(rows)})", flush=True)


if __name__ == "__main__":
    main()
