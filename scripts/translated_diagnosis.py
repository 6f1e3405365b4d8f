"""Issue 24 diagnosis: where does the shipped Qwen2.5-Coder 0.5B -> 1.5B KV map lose the target's answers?

On the 32 held-out DROP prompts dumped by ``scripts/translated_features.py`` (prompts 64..95; the shipped map is
calibrated on 0..63), with the target's true K/V and queries known:

1. per target layer: held-out R² of K and V, and the cosine between the layer's attention output (after o_proj;
   the target's own queries) computed with the mapped K/V and with the true ones (Heo et al. report that the
   attention-output cosine, not R², predicts retention); the attention sinks (first 4 rows) taken exact, as
   TranslatedCache always recomputes them, and also mapped;
2. how the error spreads over positions: the share of the total (layer-normalised, OracleScorer's) error in the
   worst 10/30/50% of positions per prompt (RaReCache's premise: "failures concentrate in a few tokens");
3. the recomputed rows (they read the mapped K/V of the others): at ratio 0.3 (oracle and first-layer
   selection), the relative K/V error of the recomputed rows at each target layer beside that of the mapped
   rows, and the next-token distribution at the prompt's end against the full prefill (KL, top-1 agreement).

The map is the shipped configuration (``KVMapper.fit`` defaults of ``python -m hf_kvreuse.translation fit``:
64 DROP prompts, stride 2, top_k 8, lambda 0.01), solved from the dumped features with the library's own
``MapperStats`` / ``KVMapper.from_stats``.

    python scripts/translated_diagnosis.py --feats /tmp/tr24/feats [--recompute-prompts 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import translated_research as R  # noqa: E402

from hf_kvreuse.translation.mapper import KVMapper, MapperConfig, MapperStats, PairGeometry  # noqa: E402


def shipped_stats(root, indices, stride: int = 2, skip_first: int = 4) -> MapperStats:
    """The library's streaming moments of the shipped map, from the dumped features."""
    g = PairGeometry(R.LS, 2, 64, R.LT, 2, 128)
    st = MapperStats(g)
    for i in indices:
        d = R.prompt(root, i)
        keep = torch.arange(skip_first, d["ids"].numel(), stride)
        x = R.source_rows(d)[:, : 2 * R.LS * R.FKV]
        st.add(x[keep], R.target_rows(d)[keep])
    return st


def mapper_predict(mapper: KVMapper):
    """``predict(x, t)`` of the research scorer for a library KVMapper (content-space K, V)."""
    def predict(x, t):
        feats = [(x[:, R.kv_block("k", s)], x[:, R.kv_block("v", s)]) for s in range(R.LS)]
        return mapper.map_layer(t, feats)
    return predict


@torch.no_grad()
def recompute_errors(root, mapper: KVMapper, indices, ratio: float = 0.3) -> dict:
    """Part 3: recomputed rows' K/V error per layer, and the end-of-prompt next-token distribution."""
    from transformers import DynamicCache

    from hf_kvreuse import FirstLayerDeviationScorer, OracleScorer, TranslatedCache, enable
    from hf_kvreuse.compat import cache_kwargs
    from hf_kvreuse.generation.partial import partial_forward
    from hf_kvreuse.models import load_qwen

    src, _ = load_qwen("0.5b", dtype=torch.bfloat16)
    tgt, _ = load_qwen("1.5b", dtype=torch.bfloat16)
    enable(tgt)
    mapper.identity = {}  # fitted from dumps of these very models; identity not recorded
    res = {}
    for i in indices:
        d = R.prompt(root, i)
        ids = d["ids"][None]
        n = ids.shape[1] - 1
        pos = torch.arange(n)
        probe = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=ratio)
        true_kv = []
        for t in range(R.LT):
            k = R.rope(d["tgt_k"][t, :n].float(), probe._shifter, pos)[None].to(torch.bfloat16)
            v = d["tgt_v"][t, :n].float().reshape(n, 2, 128).transpose(0, 1)[None].to(torch.bfloat16)
            true_kv.append((k, v))
        src_kv = []
        for s in range(R.LS):
            k = R.rope(d["src_k"][s, :n].float(), probe._src_shifter, pos)[None].to(torch.bfloat16)
            v = d["src_v"][s, :n].float().reshape(n, 2, 64).transpose(0, 1)[None].to(torch.bfloat16)
            src_kv.append((k, v))

        def last_logits(kv):
            c = DynamicCache(config=tgt.config)
            for layer, (k, v) in enumerate(kv):
                c.update(k.clone(), v.clone(), layer)
            out = tgt(input_ids=ids[:, n:], position_ids=torch.tensor([[n]]), use_cache=True, **cache_kwargs(c))
            return out.logits[0, -1].float().log_softmax(-1)

        ref = last_logits(true_kv)
        for name in ("none", "oracle", "first-layer"):
            kv = mapper.translate(src_kv, pos, probe._src_shifter, probe._shifter, torch.bfloat16)
            rows = torch.zeros(0, dtype=torch.long)
            if name != "none":
                sc = OracleScorer(true_kv) if name == "oracle" else FirstLayerDeviationScorer()
                sc.reset(n, ids.device)
                probe.input_ids = ids
                scores = sc.scores(probe, kv)
                rows, _ = probe.select(scores, n)
                partial_forward(tgt, ids[:, :n], rows, kv, layers=range(R.LT))
            mask = torch.zeros(n, dtype=torch.bool)
            mask[rows] = True
            per_layer = []
            for (k, v), (tk, tv) in zip(kv, true_kv):
                row = {}
                for part, sel in (("recomputed", mask), ("mapped", ~mask)):
                    sel = sel.clone()
                    sel[:4] = False  # sinks: outliers, always recomputed; reported apart
                    if sel.sum() == 0:
                        continue
                    for kind, (a, b) in (("k", (k, tk)), ("v", (v, tv))):
                        a, b = a[0, :, sel].float(), b[0, :, sel].float()
                        row[f"{part}_{kind}"] = float(((a - b) ** 2).sum() / (b * b).sum())
                per_layer.append(row)
            lp = last_logits(kv)
            r = res.setdefault(name, {"per_layer": [], "kl": [], "top1": []})
            r["per_layer"].append(per_layer)
            r["kl"].append(float((ref.exp() * (ref - lp)).sum()))
            r["top1"].append(int(lp.argmax() == ref.argmax()))
        print(f"recompute diag p{i}: " + " ".join(f"{k} KL {v['kl'][-1]:.3f}" for k, v in res.items()), flush=True)
    out = {}
    for name, r in res.items():
        layers = []
        for t in range(R.LT):
            keys = r["per_layer"][0][t].keys()
            layers.append({k: sum(p[t][k] for p in r["per_layer"]) / len(r["per_layer"]) for k in keys})
        out[name] = {"per_layer": layers, "kl_mean": sum(r["kl"]) / len(r["kl"]),
                     "top1_agreement": sum(r["top1"]) / len(r["top1"]), "prompts": len(r["kl"])}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--feats", default="/tmp/tr24/feats")
    p.add_argument("--calib", type=int, nargs=2, default=[0, 64])
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--attn-prompts", type=int, default=16)
    p.add_argument("--recompute-prompts", type=int, default=16)
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE.parent / "benchmarks" / "results" / "translated_diagnosis.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from safetensors.torch import load_file

    from hf_kvreuse.rope import RopeShifter

    t0 = time.perf_counter()
    st = shipped_stats(a.feats, range(*a.calib), a.stride)
    mapper = KVMapper.from_stats(st, MapperConfig(top_k=8, ridge_lambda=0.01, stride=a.stride))
    fit_s = time.perf_counter() - t0
    print(mapper, f"{fit_s:.0f} s", flush=True)
    mapper.save(Path(a.feats).parent / "maps" / "shipped")

    class _Rot:  # the target's rotary frequencies (Qwen2.5: theta 1e6, head dim 128, half layout)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
        rope_type = "default"

    shifter = RopeShifter(_Rot(), layout="half")
    o_proj = load_file(str(Path(a.feats) / "tgt_o_proj.safetensors"))
    o_proj = [o_proj[str(t)].float() for t in range(R.LT)]
    held = R.HeldOut(a.feats, R.HELD, shifter, o_proj, attn_prompts=a.attn_prompts)
    pred = mapper_predict(mapper)
    result = {"command": "python scripts/translated_diagnosis.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=HERE).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a), "map": repr(mapper),
              "map_info": mapper.info, "sources": [lm.sources for lm in mapper.layers],
              "held_out": {"drop_prompts": R.HELD, "skip_first": 4}}
    result["heldout"] = held.score(pred, attn=True, exact_sinks=True)
    print("held-out:", {k: v for k, v in result["heldout"].items() if not isinstance(v, list)}, flush=True)
    result["heldout_sinks_mapped"] = {k: v for k, v in held.score(pred, attn=True, exact_sinks=False).items()
                                      if k.startswith("attn")}
    Path(a.out).write_text(json.dumps(result, indent=1))
    if a.recompute_prompts:
        result["recompute"] = recompute_errors(a.feats, mapper, R.HELD[: a.recompute_prompts], a.ratio)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
