"""Which source layers' attention finds the answer? Calibration of the source-attention selector.

For SQuAD items disjoint from the retention items (default ``--offset 500``), the source model (Qwen2.5-Coder-0.5B)
prefills the chat QA prompt; for every layer, the attention of the marked suffix (the question) over the context
(:func:`~hf_kvreuse.translation.source_attention.row_attention`, averaged over rows and heads, max-pooled over 7)
ranks the context rows, and the score of the layer is the share of the answer-span rows (the context tokens that
mention a word of a gold answer, 4 before and 8 after, as the retention harness's ``answer-span`` diagnosis) that
fall in its top ``--budget`` share of the context (mean over items; answer words of 3+ characters). Three
readings: ``suffix`` (the marked suffix rows, the selector's default), ``last`` (the last row only), ``contrast``
(the suffix minus as many rows just before it). The layers are then ranked, and the sum over the best ``k`` is
scored the same way for k = 1, 2, 4, 8, all. Writes one JSON (config, seed, commit, figures).

    python research/translated/translated_source_layers.py --n 40 --offset 500 \\
        --out benchmarks/results/translated_source_layers.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

HERE = Path(__file__).resolve().parent


def pooled(acc: torch.Tensor, pool: int = 7) -> torch.Tensor:
    return torch.nn.functional.max_pool1d(acc[None, None], pool, stride=1, padding=pool // 2)[0, 0]


@torch.no_grad()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--offset", type=int, default=500)
    p.add_argument("--budget", type=float, default=0.25, help="share of the context rows a selector may pick")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from hf_kvreuse.focus import _WORD, mention_rows, token_texts
    from hf_kvreuse.kv import kv_of
    from hf_kvreuse.models import load_qwen
    from hf_kvreuse.rope import RopeShifter
    from hf_kvreuse.translation.mapper import run_source
    from hf_kvreuse.translation.source_attention import row_attention, source_queries
    from hf_kvreuse.workflows.datasets import qa_chat_ids, squad

    torch.set_num_threads(a.threads)
    src, tok = load_qwen("0.5b", dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype])
    shifter = RopeShifter(src)
    L = src.config.num_hidden_layers
    items = squad()[a.offset: a.offset + a.n]
    per_item = []  # [L, n] attention per layer, and the answer rows
    for j, it in enumerate(items):
        ids_list, suffix = qa_chat_ids(tok, it.passage, it.question)
        ids = torch.tensor([ids_list])
        n = ids.shape[1] - 1
        cache = DynamicCache(config=src.config)
        hidden = run_source(src, ids[:, :n], cache, range(L))
        kv = kv_of(cache)
        w = min(suffix - 1, n - 1)
        pos = torch.arange(n - w, n)
        # per layer: [rows, n] head-averaged attention of the suffix rows and of as many rows before them
        full = [row_attention(source_queries(src, s, hidden[s][n - 2 * w:], torch.arange(n - 2 * w, n), shifter),
                              kv[s][0][0], torch.arange(n - 2 * w, n)).mean(0) for s in range(L)]
        texts = token_texts(tok, ids[0].tolist())[: n - w]
        wanted = {x.lower() for x in _WORD.findall(" ".join(it.answers)) if len(x) >= 3} or \
            {x.lower() for x in _WORD.findall(" ".join(it.answers))}
        ans = mention_rows(texts, wanted, budget=len(texts), window=8, before=4, ordered=True)
        per_item.append((torch.stack(full)[:, :, 4: n - w].float(), (ans[ans >= 4] - 4), w))
        print(f"item {a.offset + j}: {n} rows, {ans.numel()} answer rows", flush=True)

    def recall(layer_set, variant="suffix") -> float:
        """Mean over items of the share of answer rows in the top ``budget`` (macro: each item counts once)."""
        vals = []
        for att, ans, w in per_item:
            if not ans.numel():
                continue
            a_ = att[list(layer_set)]
            if variant == "suffix":
                s = a_[:, w:].mean(1).sum(0)
            elif variant == "last":
                s = a_[:, -1].sum(0)
            else:  # contrast: the suffix minus as many rows before it
                s = (a_[:, w:].mean(1) - a_[:, :w].mean(1)).sum(0)
            s = pooled(s)
            k = max(1, int(a.budget * s.numel()))
            top = set(torch.topk(s, k).indices.tolist())
            vals.append(sum(int(r) in top for r in ans.tolist()) / ans.numel())
        return sum(vals) / max(1, len(vals))

    variants = {}
    for v in ("suffix", "last", "contrast"):
        per_layer = {s: recall([s], v) for s in range(L)}
        order = sorted(per_layer, key=per_layer.get, reverse=True)
        variants[v] = {"per_layer_recall": per_layer, "layer_order": order,
                       "best_k": {str(k): {"layers": sorted(order[:k]), "recall": recall(order[:k], v)}
                                  for k in (1, 2, 4, 8, L)}}
        print(v, "per layer:", {s: round(x, 3) for s, x in per_layer.items()})
        print(v, "best k:", {k: round(b["recall"], 3) for k, b in variants[v]["best_k"].items()}, flush=True)
    chance = a.budget
    res = {"command": "python research/translated/translated_source_layers.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=HERE).stdout.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a), "seed": None,
           "items": [a.offset, a.offset + a.n], "chance_recall": chance,
           "variants": variants}
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
