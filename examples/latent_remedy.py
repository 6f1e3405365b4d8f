"""Two agents, one shared block, opposite objectives: direct reuse vs LatentRemedy (Qwen2.5-Coder-0.5B-Instruct).

Agent A reads a registry under its own instruction ("you are in charge of entry X"); agent B reuses the block's
K/V that A computed and asks about entry Y. Direct reuse tends to answer A's entry; LatentRemedyCache recomputes
the block rows that mention what the two instructions disagree on and adds the shipped bridge's latents, which the
question reads through the bridge's gated read-out (loaded by default for this model).

    python examples/latent_remedy.py [--records 5]
"""

import argparse

import torch

from hf_kvreuse import ChunkStore, DirectReuseCache, LatentBridge, LatentRemedyCache, enable
from hf_kvreuse.models import load_qwen
from hf_kvreuse.workflows import conflict_records, is_correct, prompt_parts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=5)
    ap.add_argument("--family", default="retrieval")
    a = ap.parse_args()
    model, tok = load_qwen("0.5b")
    enable(model)
    bridge = LatentBridge.from_pretrained(model)   # the shipped checkpoint (hf_kvreuse/latent/checkpoints)
    print(f"shipped bridge: n_latent={bridge.n_latent}, read-out {bridge.readout!r}, rows {bridge.rows!r}")
    for rec in conflict_records(a.family, a.records, seed=2024):
        ids_a, (sa, _) = prompt_parts(tok, rec, "a")
        ids_b, span = prompt_parts(tok, rec, "b")
        x = torch.tensor([ids_b])
        store = ChunkStore()
        donor_prefix = torch.tensor(ids_a[:sa])      # the block as agent A computed it, under A's prefix
        outs = {"full": model.generate(x, max_new_tokens=8, do_sample=False)}
        outs["reuse"] = model.generate(x, cache=DirectReuseCache(model, x, [span], store=store,
                                                                 block_prefix_ids=donor_prefix),
                                       max_new_tokens=8, do_sample=False)
        # the shipped bridge was trained with focus rows (bridge.rows == "focus"): the cache needs the tokenizer
        outs["latent"] = model.generate(x, cache=LatentRemedyCache(model, x, [span], bridge=bridge, store=store,
                                                                   block_prefix_ids=donor_prefix, focus=tok),
                                        max_new_tokens=8, do_sample=False)
        answers = {k: tok.decode(v[0, x.shape[1]:], skip_special_tokens=True).strip() for k, v in outs.items()}
        print(f"B's gold {rec.gold_b!r} (A's {rec.gold_a!r}): " + ", ".join(
            f"{k} {v!r}{'' if is_correct(v, rec.gold_b) else ' x'}" for k, v in answers.items()))


if __name__ == "__main__":
    main()
