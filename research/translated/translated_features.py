"""Dump the per-position features of the Qwen2.5-Coder 0.5B -> 1.5B pair on DROP prompts (issue 24 research data).

One safetensors file per prompt (``p{index}.safetensors``, ``index`` = position in
``hf_kvreuse.translation.pairs.calibration_ids(tok, 405)``: the unique DROP passages, chat QA format, <= 512
tokens), float16:

* ``src_k``, ``src_v`` ``[Ls, T, 128]``: the source's RoPE-stripped keys and values (the shipped map's inputs);
* ``src_h`` ``[Ls, T, 896]``: the source's normalised residual stream entering each layer (``input_layernorm``
  output: what that layer's q/k/v projections read); ``src_hf`` ``[T, 896]``: after the final norm;
* ``tgt_k``, ``tgt_v`` ``[Lt, T, 256]``: the target's RoPE-stripped keys and values (the maps' outputs);
* ``tgt_h`` ``[4, T, 1536]``: the target's normalised input of layers 0..3;
* with ``--queries`` (held-out prompts): ``tgt_q`` ``[Lt, T, 1536]``, the target's queries before RoPE.

These are scratch research files (``/tmp``), not artifacts: the shipped map is fitted by
``python -m hf_kvreuse.translation fit``.

    python research/translated/translated_features.py --out /tmp/tr24/feats --range 64 96 --queries
    python research/translated/translated_features.py --out /tmp/tr24/feats --range 0 64
    python research/translated/translated_features.py --data squad-other --out /tmp/tr24/feats_sq --range 0 119

``--data squad-other``: in-domain calibration for the SQuAD retention set: the unique passages of the SQuAD
articles (titles) that none of the first ``--exclude-first`` items (the retention and held-out items) comes from,
one question each, in file order (``p{index}`` = position in that list).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import kv_of
from hf_kvreuse.model_check import require
from hf_kvreuse.rope import RopeShifter
from hf_kvreuse.translation.mapper import content_features

N_DROP = 405  # unique DROP passages


def squad_other_ids(tok, exclude_first: int = 100, max_tokens: int = 512) -> list[torch.Tensor]:
    """Chat QA prompts over the unique passages of SQuAD articles that none of the first ``exclude_first`` items
    comes from (in-domain calibration that shares no article with the retention items)."""
    from hf_kvreuse.workflows.datasets import qa_chat_ids, squad

    items = squad()
    test_titles = {it.title for it in items[:exclude_first]}
    seen, out = set(), []
    for it in items:
        if it.title in test_titles or it.passage in seen:
            continue
        seen.add(it.passage)
        ids, _ = qa_chat_ids(tok, it.passage, it.question)
        out.append(torch.tensor(ids[:max_tokens]))
    return out


@torch.no_grad()
def run_with_hooks(model, ids: torch.Tensor, shifter: RopeShifter, norm_layers, q: bool = False,
                   final: bool = False) -> dict:
    """One forward; the per-layer content K/V, the normalised layer inputs of ``norm_layers`` (and the queries)."""
    layers = model.model.layers
    grabbed: dict = {}
    hooks = []
    for i in norm_layers:
        hooks.append(layers[i].input_layernorm.register_forward_hook(
            lambda m, a, out, i=i: grabbed.__setitem__(("h", i), out[0].detach())))
    if q:
        for i in range(len(layers)):
            hooks.append(layers[i].self_attn.q_proj.register_forward_hook(
                lambda m, a, out, i=i: grabbed.__setitem__(("q", i), out[0].detach())))
    if final:
        hooks.append(model.model.norm.register_forward_hook(
            lambda m, a, out: grabbed.__setitem__(("f", 0), out[0].detach())))
    try:
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    finally:
        for h in hooks:
            h.remove()
    feats = content_features(kv_of(cache), shifter, torch.arange(ids.shape[1]))
    out = {"k": torch.stack([k for k, _ in feats]).half(), "v": torch.stack([v for _, v in feats]).half()}
    if norm_layers:
        out["h"] = torch.stack([grabbed[("h", i)] for i in norm_layers]).half()
    if q:
        out["q"] = torch.stack([grabbed[("q", i)] for i in range(len(layers))]).half()
    if final:
        out["f"] = grabbed[("f", 0)].half()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--range", type=int, nargs=2, required=True, metavar=("START", "STOP"))
    p.add_argument("--queries", action="store_true", help="also store the target's queries (held-out prompts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="model dtype (fp32: this CPU has no bf16 units; bf16 matmuls measured 3.5-6x slower)")
    p.add_argument("--data", choices=["drop", "squad-other"], default="drop")
    p.add_argument("--exclude-first", type=int, default=100, help="squad-other: items whose articles are left out")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from hf_kvreuse.models import load_qwen
    from hf_kvreuse.translation.pairs import calibration_ids

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    src, tok = load_qwen("0.5b", dtype=dtype)
    tgt, _ = load_qwen("1.5b", dtype=dtype)
    ss = RopeShifter(src, layout=require(src, rope=True).rope_layout)
    ts = RopeShifter(tgt, layout=require(tgt, rope=True).rope_layout)
    prompts = (calibration_ids(tok, N_DROP, 512) if a.data == "drop" else squad_other_ids(tok, a.exclude_first, 512))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tgt_o_proj.safetensors").exists():  # for the attention-output cosine after o_proj
        save_file({str(i): l.self_attn.o_proj.weight.detach().float().contiguous() for i, l in enumerate(tgt.model.layers)},
                  str(out / "tgt_o_proj.safetensors"))
    t0 = time.perf_counter()
    for i in range(a.range[0], min(a.range[1], len(prompts))):
        path = out / f"p{i}.safetensors"
        if path.exists():
            continue
        ids = prompts[i].reshape(1, -1)
        s = run_with_hooks(src, ids, ss, range(src.config.num_hidden_layers), final=True)
        t = run_with_hooks(tgt, ids, ts, range(4), q=a.queries)
        tensors = {"ids": ids[0].clone(), "src_k": s["k"], "src_v": s["v"], "src_h": s["h"], "src_hf": s["f"],
                   "tgt_k": t["k"], "tgt_v": t["v"], "tgt_h": t["h"]}
        if a.queries:
            tensors["tgt_q"] = t["q"]
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.rename(path)
        print(f"p{i}: {ids.shape[1]} tokens, {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
