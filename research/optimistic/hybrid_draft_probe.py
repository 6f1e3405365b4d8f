"""Would verified drafts pay on a linear-attention hybrid? Acceptance of drafts built from another agent's cache.

Two agents read one shared block after role texts of equal length (so the block sits at the same positions in
both prompts and no re-positioning is involved: the probe isolates what a recurrent state costs a draft):
``donor = [role A][block][question A]``, ``target = [role B][block][question B]``. A draft of the target's cache:

* the target's own role text computed (exact);
* attention layers: the donor's K/V rows of the block (computed after role A) appended;
* recurrent-state layers (gated delta rule: a convolution state and a recurrent state), one of
  ``donor``: the donor's state after ``[role A][block]`` (copied where the block ends);
  ``own``: the target's own state after its role text (the block skipped);
  ``zero``: an empty state (as if the question started the text);
* the target's question computed over that cache; then ``--new-tokens`` greedy tokens decoded from it.

Acceptance = the leading draft tokens equal to plain ``generate``'s (what ``rebase="verify"`` would keep), over
``--new-tokens``; ``first`` = the first token equal; ``top1`` = the share of all draft positions whose token
equals plain generate's at that position. A dense control runs the same prompts on tiny random-init dense models
(``qwen2``, ``llama``) where the draft is exact for the role and question and reuses the donor's block K/V
(what OptimisticCache drafts do): how much the state costs beyond what reusing K/V costs. A gate checks that a
draft from the target's own cache (donor = target) reproduces plain generate's tokens and logits.

The models are tiny and random-init (no hybrid checkpoint ships offline): the figures say whether the state
approximation is in the range of the K/V approximation on the same kind of model, not what a trained Qwen3.5
would accept. JSON with config, seed, commit and figures::

    python research/optimistic/hybrid_draft_probe.py --trials 200 --out benchmarks/results/hybrid_draft_probe.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # common: the results scripts' shared helpers
VARIANTS = ("donor", "own", "zero")
#: the floor: a draft whose block K/V and state come from another, unrelated block (how much the model's next
#: tokens depend on the block at all; near the variants above, the probe cannot tell them apart)
FLOOR = "unrelated"


def _fwd(model, ids, cache, start: int):
    from hf_kvreuse.compat import cache_kwargs

    pos = torch.arange(start, start + ids.shape[1])[None]
    return model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **cache_kwargs(cache)).logits[0, -1]


def _state_idx(cache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if not hasattr(layer, "keys") or hasattr(layer, "recurrent_states")]


@torch.no_grad()
def draft(model, role, block, question, donor_role, variant: str, new_tokens: int, donor_block=None):
    """Greedy tokens and logits from a draft of ``[role][block][question]`` built from the donor's cache of
    ``[donor_role][block]`` (see the module docstring; ``donor_block``: the donor read another block)."""
    r, b = role.shape[1], block.shape[1]
    donor = DynamicCache(config=model.config)
    _fwd(model, torch.cat([donor_role, block if donor_block is None else donor_block], 1), donor, 0)
    cache = DynamicCache(config=model.config)
    _fwd(model, role, cache, 0)
    states = _state_idx(cache)
    for i, layer in enumerate(cache.layers):
        if i in states:
            if variant == "donor":
                cache.layers[i] = copy.deepcopy(donor.layers[i])
            elif variant == "zero":
                fresh = DynamicCache(config=model.config).layers[i]
                cache.layers[i] = fresh
            continue  # "own": the state after the role text stays
        dk, dv = donor.layers[i].keys, donor.layers[i].values
        layer.keys = torch.cat([layer.keys, dk[..., r:r + b, :]], -2)
        layer.values = torch.cat([layer.values, dv[..., r:r + b, :]], -2)
    # the question: all its tokens, then greedy decoding one token at a time
    pos = r + b
    logits = [_fwd(model, question, cache, pos)]
    pos += question.shape[1]
    toks = [int(logits[-1].argmax())]
    for _ in range(new_tokens - 1):
        logits.append(_fwd(model, torch.tensor([[toks[-1]]]), cache, pos))
        pos += 1
        toks.append(int(logits[-1].argmax()))
    return toks, torch.stack(logits)


@torch.no_grad()
def plain(model, ids, new_tokens: int):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits)[:, 0]


def accepted(d: list[int], ref: list[int]) -> int:
    n = 0
    for x, y in zip(d, ref):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> None:
    from hf_kvreuse.models.arch_zoo import HYBRIDS, hybrid_model, zoo_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=200, help="prompt pairs per model (seeds 0..trials-1)")
    p.add_argument("--role", type=int, default=8)
    p.add_argument("--block", type=int, default=48)
    p.add_argument("--question", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--models", nargs="+", default=[*HYBRIDS, "qwen2", "llama"])
    p.add_argument("--decay", nargs="*", default=["init", "0.02"],
                   help="hybrids: one run per value, every gated-delta head's A set to it (init: the random init's "
                        "A ~ U(0.01, 16), which forgets within a few tokens; 0.02 keeps ~40 tokens)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_draft_probe.json"))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    from common import git_commit

    commit = git_commit(ROOT)
    res = {"command": "python research/optimistic/hybrid_draft_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "args": vars(a), "git_commit": commit, "date": time.strftime("%F %T"), "models": {}}
    runs = [(m, d) for m in a.models for d in ([None if x == "init" else float(x) for x in a.decay]
                                                        if m in HYBRIDS else [None])]
    for name, decay in runs:
        model = hybrid_model(name) if name in HYBRIDS else zoo_model(name)
        if decay is not None:
            with torch.no_grad():
                for mod in model.modules():
                    if hasattr(mod, "A_log"):
                        mod.A_log.fill_(float(torch.tensor(decay).log()))
            name = f"{name} (A={decay})"
        vocab = min(int(model.config.vocab_size), 128)
        hybrid = bool(_state_idx(DynamicCache(config=model.config)))
        variants = (VARIANTS if hybrid else ("kv",)) + (FLOOR,)
        acc = {v: [] for v in variants}
        first = {v: 0 for v in variants}
        top1 = {v: 0 for v in variants}
        gate_err = 0.0
        for t in range(a.trials):
            g = torch.Generator().manual_seed(t)
            ra, rb = (torch.randint(3, vocab, (1, a.role), generator=g) for _ in range(2))
            block = torch.randint(3, vocab, (1, a.block), generator=g)
            qb = torch.randint(3, vocab, (1, a.question), generator=g)
            ref, ref_logits = plain(model, torch.cat([rb, block, qb], 1), a.new_tokens)
            if t < 5:  # the gate: a draft from the target's own cache is plain generate
                own_toks, own_logits = draft(model, rb, block, qb, rb, variants[0], a.new_tokens)
                if own_toks != ref:
                    raise SystemExit(f"{name}: a draft from the target's own cache differs from plain generate")
                gate_err = max(gate_err, float((own_logits - ref_logits).abs().max()))
            other = torch.randint(3, vocab, (1, a.block), generator=g)
            for v in variants:
                if v == FLOOR:  # the donor's cache of another block, reused as if it were this block's
                    toks, _ = draft(model, rb, block, qb, ra, "donor", a.new_tokens, donor_block=other)
                else:
                    toks, _ = draft(model, rb, block, qb, ra, "donor" if v == "kv" else v, a.new_tokens)
                acc[v].append(accepted(toks, ref))
                first[v] += toks[0] == ref[0]
                top1[v] += sum(x == y for x, y in zip(toks, ref))
        n = a.trials
        res["models"][name] = {
            "hybrid": hybrid, "layer_types": list(getattr(model.config, "layer_types", []) or []),
            "gate_max_logit_diff": gate_err,
            "variants": {v: {"accepted_mean": sum(acc[v]) / n, "accepted_share": sum(acc[v]) / (n * a.new_tokens),
                             "first_token_equal": first[v] / n, "top1_agreement": top1[v] / (n * a.new_tokens),
                             "all_accepted": sum(x == a.new_tokens for x in acc[v]) / n}
                         for v in variants},
            "computed_share": (a.role + a.question) / (a.role + a.block + a.question)}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(name, json.dumps(res["models"][name]["variants"]), f"gate {gate_err:.2g}", flush=True)


def table(doc: dict) -> str:
    """Markdown rows of a probe JSON: per model and draft variant, the acceptance figures."""
    lines = [f"{doc['args']['trials']} prompt pairs per model; role {doc['args']['role']}, block {doc['args']['block']}, "
             f"question {doc['args']['question']} tokens; {doc['args']['new_tokens']} greedy tokens per draft", "",
             "| model | recurrent-state layers | draft | accepted (mean of "
             f"{doc['args']['new_tokens']}) | all accepted | first token equal | per-position agreement |",
             "|---|---|---|---|---|---|---|"]
    for name, m in doc["models"].items():
        for v, f in m["variants"].items():
            lines.append(f"| {name} | {'yes' if m['hybrid'] else 'no'} | {v} | {f['accepted_mean']:.2f} | "
                         f"{100 * f['all_accepted']:.0f}% | {100 * f['first_token_equal']:.0f}% | "
                         f"{100 * f['top1_agreement']:.0f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    from common import run_or_table

    run_or_table(main, table)
