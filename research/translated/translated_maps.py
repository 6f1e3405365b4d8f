"""Issue 24 map ablations on the Qwen2.5-Coder 0.5B -> 1.5B pair, scored on held-out prompts with the target's true
K/V and queries known (held-out R², attention-output cosine, error spread; research/translated/translated_research.py).

``moments``: accumulate :class:`~hf_kvreuse.translation.moments.BlockMoments` over dumped DROP calibration prompts
(research/translated/translated_features.py; waits for files still being dumped) and save them (scratch, /tmp).
``ablate``: merge saved moments, solve every linear variant with the library's ``KVMapper.from_moments`` and score
each on the held-out items (the first ``--held`` prepared SQuAD items of research/translated/translated_retention.py: never
calibrated on); one JSON under benchmarks/results/. ``--save NAME=DIR`` keeps a variant as a map (retention runs).

    python research/translated/translated_maps.py moments --range 0 16 --out /tmp/tr24/mom/a.safetensors
    python research/translated/translated_maps.py ablate --moments /tmp/tr24/mom/a.safetensors /tmp/tr24/mom/b.safetensors \\
        --held 24 --out benchmarks/results/translated_maps_linear.json
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

from hf_kvreuse.translation.mapper import KVMapper, MapperConfig  # noqa: E402


def variants() -> dict:
    """name -> (MapperConfig, blocks override or None). The first is the shipped kind on the same rows."""
    v = {
        "kv (shipped kind)": (MapperConfig(inputs="kv"), None),
        "hidden band1": (MapperConfig(inputs="hidden", hidden_band=1, scaling="std"), None),
        "kv+hidden band1": (MapperConfig(inputs="kv+hidden", hidden_band=1, scaling="std"), None),
        "kv-both": (MapperConfig(inputs="kv-both"), None),
        "hidden band0": (MapperConfig(inputs="hidden", hidden_band=0, scaling="std"), None),
        "kv+hidden band1 mean-scaled": (MapperConfig(inputs="kv+hidden", hidden_band=1, scaling="mean"), None),
        "kv-both std": (MapperConfig(inputs="kv-both", scaling="std"), None),
    }
    for lam in (0.3, 3.0, 30.0):
        v[f"hidden band1 lambda {lam}"] = (MapperConfig(inputs="hidden", hidden_band=1, scaling="std",
                                                        ridge_lambda=lam), None)
        v[f"kv+hidden band1 lambda {lam}"] = (MapperConfig(inputs="kv+hidden", hidden_band=1, scaling="std",
                                                           ridge_lambda=lam), None)
    for lam in (0.1, 1.0):
        v[f"kv lambda {lam}"] = (MapperConfig(inputs="kv", ridge_lambda=lam), None)
    return v


def _git() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["moments", "ablate", "residual", "table"])
    p.add_argument("--feats", default="/tmp/tr24/feats")
    p.add_argument("--squad", default="/tmp/tr24/squad")
    p.add_argument("--range", type=int, nargs=2)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--moments", nargs="+", default=[], help="saved moments to merge (ablate)")
    p.add_argument("--more", nargs="*", default=[], help="extra moments: also score the variants fitted on all")
    p.add_argument("--held", type=int, default=16, help="held-out prepared SQuAD items")
    p.add_argument("--attn-prompts", type=int, default=8)
    p.add_argument("--only", nargs="*", default=None, help="variant names to run")
    p.add_argument("--save", action="append", default=[], help="NAME=DIR: save that variant's map")
    p.add_argument("--fit-only", action="store_true", help="fit and --save the variants, score nothing")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", default="kv+hidden band1", help="residual: the linear map it corrects")
    p.add_argument("--layers", type=int, nargs="*", default=[], help="residual: target layers (default: all)")
    p.add_argument("--base", default=None, help="residual: a saved linear map to correct (else --variant)")
    p.add_argument("--calib", type=int, nargs=2, default=[0, 24], help="residual: dumped prompts it trains on")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3, help="residual: Adam learning rate")
    p.add_argument("--held-calib", type=int, nargs=2, default=None,
                   help="residual: held-out rows from these dumped DROP prompts (the calibration distribution) "
                        "instead of the SQuAD items")
    p.add_argument("--out", default="-")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.command == "moments":
        t0 = time.perf_counter()
        m = R.accumulate(a.feats, range(*a.range), a.stride, wait=True, log=lambda s: print(s, flush=True))
        R.save_moments(m, Path(a.out))
        print(f"{m.n} rows, {m.nbytes / 2**30:.2f} GiB of moments, {time.perf_counter() - t0:.0f} s -> {a.out}")
        return

    if a.command == "residual":
        return residual(a, argv)
    if a.command == "table":
        print(table(a.moments))
        return
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    m = R.load_moments(Path(a.moments[0]))
    for f in a.moments[1:]:
        m.merge(R.load_moments(Path(f)))
    src_sh, tgt_sh = R.qwen_shifters()
    o_proj = load_file(str(Path(a.feats) / "tgt_o_proj.safetensors"))
    o_proj = [o_proj[str(t)].float() for t in range(R.LT)]
    held = None if a.fit_only else R.HeldOut([R.squad_item(a.squad, i, src_sh, tgt_sh) for i in range(a.held)],
                                             tgt_sh, o_proj, attn_prompts=a.attn_prompts)
    out = Path(a.out)
    result = {"command": "python research/translated/translated_maps.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "git_commit": _git(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a),
              "calibration_rows": m.n, "held_out": f"SQuAD items 0..{a.held - 1} (chat QA prompts)",
              "variants": {}}
    if out.exists():
        result["variants"] = json.loads(out.read_text()).get("variants", {})
    saves = dict(s.split("=", 1) for s in a.save)
    sets = [("", m)]
    if a.more:
        big = R.load_moments(Path(a.moments[0]))
        for f in a.moments[1:] + a.more:
            big.merge(R.load_moments(Path(f)))
        sets.append((f" [{big.n} rows]", big))
    for name, (cfg, blocks) in variants().items():
        if a.only is not None and name not in a.only:
            continue
        for suffix, mm in sets:
            key = name + suffix
            if key in result["variants"] and key not in saves:
                continue
            t1 = time.perf_counter()
            mapper = KVMapper.from_moments(mm, R.GEOMETRY, cfg, blocks)
            fit_s = time.perf_counter() - t1
            if a.fit_only:
                mapper.save(saves[key])
                print(f"{key}: fitted in {fit_s:.0f} s, saved at {saves[key]}", flush=True)
                continue
            score = held.score(R.mapper_predict(mapper))
            score.update(fit_solve_s=fit_s, in_sample_r2_k=float(mapper.fit_r2[:, 0].mean()),
                         in_sample_r2_v=float(mapper.fit_r2[:, 1].mean()), calibration_rows=mm.n,
                         map_mb=mapper.nbytes / 2**20, config=cfg.__dict__)
            result["variants"][key] = score
            print(f"{key}: R2 K {score['r2_k_mean']:.3f} V {score['r2_v_mean']:.3f} attn cos "
                  f"{score.get('attn_cos_mean', float('nan')):.4f} (in-sample {score['in_sample_r2_k']:.3f}/"
                  f"{score['in_sample_r2_v']:.3f}; {fit_s:.0f} s)", flush=True)
            if key in saves:
                mapper.save(saves[key])
            out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")


def table(paths: list[str]) -> str:
    """README rows of ablation JSONs (``table --moments A.json B.json --out -``)."""
    lines = ["| map kind (inputs per target layer) | ridge | calibration rows | held-out R² K | R² V | attn-output cos | "
             "in-sample R² K / V | worst 10/30/50% of positions hold | solve s | map MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        for name, v in json.loads(Path(path).read_text())["variants"].items():
            c = v["config"]
            w = v["error_share_worst"]
            lines.append(f"| {name} | {c['ridge_lambda']} ({c['scaling']}) | {v['calibration_rows']} | "
                         f"{v['r2_k_mean']:.3f} | {v['r2_v_mean']:.3f} | {v.get('attn_cos_mean', float('nan')):.3f} | "
                         f"{v['in_sample_r2_k']:.2f} / {v['in_sample_r2_v']:.2f} | "
                         f"{100 * w['top10']:.0f} / {100 * w['top30']:.0f} / {100 * w['top50']:.0f}% | "
                         f"{v['fit_solve_s']:.0f} | {v['map_mb']:.0f} |")
    return "\n".join(lines)


def residual(a, argv) -> None:
    """(c) a low-rank non-linear residual per target layer on top of a linear map (the library's
    :func:`~hf_kvreuse.translation.residual.train_residual`: ``[K~|V] += gelu(((x - mu) / sd) A + c) U``), trained on
    the calibration dumps ``--calib``; held-out R² of the linear map and of linear + residual per layer (the first
    ``--held`` prepared SQuAD items). ``--base DIR``: correct a saved map (else solve ``--variant`` from
    ``--moments``); ``--save DIR``: keep the corrected map (retention runs); ``--layers`` none given: all."""
    from hf_kvreuse.translation.residual import ResidualConfig, apply_residual, train_residual

    t0 = time.perf_counter()
    if a.base:
        mapper = KVMapper.load(a.base)
    else:
        m = R.load_moments(Path(a.moments[0]))
        for f in a.moments[1:]:
            m.merge(R.load_moments(Path(f)))
        cfg, blocks = variants()[a.variant]
        mapper = KVMapper.from_moments(m, R.GEOMETRY, cfg, blocks)
    rcfg = ResidualConfig(rank=a.rank, epochs=a.epochs, lr=a.lr)
    src_sh, tgt_sh = R.qwen_shifters()
    held = ([R.prompt(a.feats, i) for i in range(*a.held_calib)] if a.held_calib else
            [R.squad_item(a.squad, i, src_sh, tgt_sh) for i in range(a.held)])
    xs_h = torch.cat([R.source_rows(d)[4:] for d in held])
    ys_h = torch.cat([R.target_rows(d)[4:] for d in held])
    calib = [R.prompt(a.feats, i) for i in range(*a.calib)]
    xf = torch.cat([R.source_rows(d)[4:] for d in calib])
    yf = torch.cat([R.target_rows(d)[4:] for d in calib])
    del calib
    result = {"command": "python research/translated/translated_maps.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "git_commit": _git(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a),
              "base": a.base or a.variant, "residual_config": vars(rcfg), "calibration_rows": int(xf.shape[0]),
              "held_out_rows": int(xs_h.shape[0]), "layers": {}}
    out = Path(a.out)
    pred = R.mapper_predict(mapper)

    def r2(p_, y_):
        return 1 - float(((p_ - y_) ** 2).sum() / ((y_ - y_.mean(0)) ** 2).sum())

    def r2_split(p_, y_):
        return r2(p_[:, :R.FT], y_[:, :R.FT]), r2(p_[:, R.FT:], y_[:, R.FT:])

    for t in a.layers or range(R.LT):
        lm = mapper.layers[t]
        lm.residual = None
        bu = lm.union_blocks()
        x = torch.cat([xf[:, R.LAYOUT.cols(b)] for b in bu], 1)
        y = yf[:, t * 2 * R.FT:(t + 1) * 2 * R.FT]
        lin = torch.cat(pred(xf, t), 1)
        res, stats = train_residual(x, lin, y, rcfg)
        with torch.no_grad():
            xh = torch.cat([xs_h[:, R.LAYOUT.cols(b)] for b in bu], 1)
            yh = ys_h[:, t * 2 * R.FT:(t + 1) * 2 * R.FT]
            lin_h = torch.cat(pred(xs_h, t), 1)
            by_hand = lin_h + apply_residual(res, xh)
            lm.residual = res
            lib = torch.cat(pred(xs_h, t), 1)   # the library's map_layer with the correction attached
            assert torch.allclose(lib, by_hand, atol=1e-3, rtol=1e-4), "map_layer does not apply the trained residual"
        result["layers"][str(t)] = {"linear_heldout_r2_kv": r2_split(lin_h, yh), "residual_heldout_r2_kv": r2_split(lib, yh),
                                    "linear_insample_r2_kv": stats["linear_r2"],
                                    "residual_insample_r2_kv": stats["residual_r2"], "train_rows": stats["rows"],
                                    "inputs": x.shape[1], "train_s": stats["seconds"]}
        print(t, result["layers"][str(t)]["linear_heldout_r2_kv"], "->", result["layers"][str(t)]["residual_heldout_r2_kv"],
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        out.write_text(json.dumps(result, indent=1))
    L = result["layers"].values()
    result["mean"] = {key: [sum(r[key][i] for r in L) / len(L) for i in (0, 1)]
                      for key in ("linear_heldout_r2_kv", "residual_heldout_r2_kv", "linear_insample_r2_kv",
                                  "residual_insample_r2_kv")}
    result["fit_s"] = time.perf_counter() - t0
    if a.save:
        mapper.info["residual"] = {"config": vars(rcfg), "calibration_rows": int(xf.shape[0]),
                                   "calibration": f"DROP dumps {a.calib[0]}..{a.calib[1] - 1} (research/translated/translated_features.py)",
                                   "layers": {t: {k: r[k] for k in ("residual_insample_r2_kv", "train_rows")}
                                              for t, r in result["layers"].items()}}
        saved = mapper.save(a.save[0].split("=", 1)[-1])
        result["saved"] = str(saved)
        result["map_mb"] = mapper.nbytes / 2 ** 20
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["mean"]), f"{result['fit_s']:.0f} s", flush=True)

if __name__ == "__main__":
    main()
