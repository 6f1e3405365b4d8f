"""Shared helpers of the issue-24 research scripts (translated_diagnosis.py, translated_maps.py): read the feature
dumps of ``translated_features.py``, accumulate calibration moments over every source feature once, solve any
linear map variant from them, and score a map on held-out prompts (R², attention-output cosine, error spread).

Feature layout of one row (source side, float32): blocks ``("k", s)``, ``("v", s)`` for ``s < Ls`` (128 each:
RoPE-stripped keys, values), then ``("h", s)`` for ``s <= Ls`` (896 each: the normalised input of source layer
``s``; ``s = Ls`` is the final norm's output). Targets: per target layer ``[K~ (256) | V (256)]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from hf_kvreuse.translation.mapper import PairGeometry
from hf_kvreuse.translation.moments import BlockLayout, BlockMoments

LS, LT = 24, 28           # source / target layers of the Qwen2.5-Coder 0.5B -> 1.5B pair
FKV, FH, FT = 128, 896, 256
HELD = list(range(64, 88))   # held-out DROP prompts (the shipped map is calibrated on 0..63)


def prompt(root: str | Path, i: int) -> dict:
    return load_file(str(Path(root) / f"p{i}.safetensors"))


def kv_block(kind: str, s: int) -> slice:
    """Columns of block (kind, s) in the full source row."""
    if kind in ("k", "v"):
        o = (2 * s + (kind == "v")) * FKV
        return slice(o, o + FKV)
    o = 2 * LS * FKV + s * FH
    return slice(o, o + FH)


NFEAT = 2 * LS * FKV + (LS + 1) * FH


def source_rows(d: dict) -> torch.Tensor:
    """``[T, NFEAT]`` float32 source features of one dumped prompt."""
    T = d["ids"].numel()
    kv = torch.stack([d["src_k"], d["src_v"]], dim=1).permute(2, 0, 1, 3).reshape(T, -1)  # [T, Ls*2*128]
    h = torch.cat([d["src_h"].permute(1, 0, 2).reshape(T, -1), d["src_hf"]], dim=-1)
    return torch.cat([kv, h], dim=-1).float()


def target_rows(d: dict) -> torch.Tensor:
    """``[T, LT * 512]``: per target layer K~ then V."""
    T = d["ids"].numel()
    return torch.stack([d["tgt_k"], d["tgt_v"]], dim=1).permute(2, 0, 1, 3).reshape(T, -1).float()


LAYOUT = BlockLayout(LS, FKV, FH)
GEOMETRY = PairGeometry(LS, 2, 64, LT, 2, 128)


def new_moments(band: int = 1, dtype=torch.float32) -> BlockMoments:
    return BlockMoments(LAYOUT, LT, FT, band=band, cross=True, dtype=dtype)


def accumulate(root: str | Path, indices, stride: int = 1, skip_first: int = 4, band: int = 1,
               wait: bool = False, log=print) -> BlockMoments:
    """BlockMoments over the dumped calibration prompts ``indices`` (with ``wait``: for files still being dumped)."""
    import time

    m = new_moments(band)
    for i in indices:
        path = Path(root) / f"p{i}.safetensors"
        while wait and not path.exists():
            time.sleep(20)
        d = prompt(root, i)
        keep = torch.arange(skip_first, d["ids"].numel(), stride)
        t0 = time.perf_counter()
        m.add(source_rows(d)[keep], target_rows(d)[keep])
        log(f"moments p{i}: {m.n} rows ({time.perf_counter() - t0:.0f} s)")
    return m


def save_moments(m: BlockMoments, path: Path) -> None:
    from safetensors.torch import save_file

    t = {"n": torch.tensor(m.n), "shift_x": m.shift_x, "shift_y": m.shift_y, "sx": m.sx, "sy": m.sy, "yy": m.yy,
         "g_kv": m.g_kv, "g_kh": m.g_kh, "xy_kv": m.xy_kv}
    t.update({f"g_hh.{a}.{b}": g for (a, b), g in m.g_hh.items()})
    t.update({f"xy_h.{k}": g for k, g in m.xy_h.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path))


def load_moments(path: Path, band: int = 1) -> BlockMoments:
    t = load_file(str(path))
    m = new_moments(band)
    m.n = int(t["n"])
    for k in ("shift_x", "shift_y", "sx", "sy", "yy", "g_kv", "g_kh", "xy_kv"):
        setattr(m, k, t[k])
    m.g_hh = {tuple(int(x) for x in k.split(".")[1:]): v for k, v in t.items() if k.startswith("g_hh.")}
    m.xy_h = {int(k.split(".")[1]): v for k, v in t.items() if k.startswith("xy_h.")}
    return m


def mapper_predict(mapper):
    """``predict(x, t)`` over full source rows for a library KVMapper (content-space K, V)."""
    def predict(x, t):
        feats = [(x[:, LAYOUT.cols(("k", s))], x[:, LAYOUT.cols(("v", s))]) for s in range(LS)]
        hidden = {s: x[:, LAYOUT.cols(("h", s))] for s in range(LS + 1)}
        return mapper.map_layer(t, feats, hidden)
    return predict


def squad_item(root: str | Path, i: int, src_shifter, tgt_shifter) -> dict:
    """A prepared SQuAD item (research/translated/translated_retention.py prepare) in the dump format (content space)."""
    d = load_file(str(Path(root) / f"i{i}.safetensors"))
    n = d["tgt_k"].shape[2]
    pos = torch.arange(n)

    def strip(k, sh):  # [L, H, n, D] post-RoPE -> [L, n, H*D]
        c = sh.shift(k.float(), None, sh.cos_sin(-pos, k.device))
        return c.transpose(1, 2).reshape(k.shape[0], n, -1)

    out = {"ids": d["ids"][:n], "src_k": strip(d["src_k"], src_shifter).half(),
           "src_v": d["src_v"].transpose(1, 2).reshape(LS, n, -1).half(),
           "src_h": d["src_h"][:LS], "src_hf": d["src_h"][LS],
           "tgt_k": strip(d["tgt_k"], tgt_shifter).half(), "tgt_v": d["tgt_v"].transpose(1, 2).reshape(LT, n, -1).half()}
    if "tgt_q" in d:
        out["tgt_q"] = d["tgt_q"]
    return out


def qwen_shifters():
    """RopeShifters of the pair without loading the models (Qwen2.5: theta 1e6, half layout; head dims 64, 128)."""
    from hf_kvreuse.rope import RopeShifter

    class _Rot:
        def __init__(self, d):
            self.inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            self.rope_type = "default"

    return RopeShifter(_Rot(64), layout="half"), RopeShifter(_Rot(128), layout="half")


# -- held-out scoring ----------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, shifter, positions: torch.Tensor) -> torch.Tensor:
    """``x [T, H*D]`` content space -> post-RoPE ``[H, T, D]`` (float32)."""
    T = x.shape[0]
    h = x.shape[1] // 128
    return shifter.shift(x.reshape(T, h, 128).transpose(0, 1)[None].float(), None,
                         shifter.cos_sin(positions, x.device))[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention: q ``[Hq, T, D]``, k/v ``[Hk, T, D]`` -> ``[T, Hq*D]``."""
    hq, T, D = q.shape
    rep = hq // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = q @ k.transpose(1, 2) / math.sqrt(D)
    s.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(T, hq * D)


class HeldOut:
    """Held-out prompts in memory (source rows, target rows, queries) for scoring map variants; ``items`` are
    dicts in the dump format (``prompt`` or ``squad_item``)."""

    def __init__(self, items, shifter=None, o_proj=None, attn_prompts: int = 16, skip_first: int = 4):
        self.items = []
        for j, d in enumerate(items):
            it = {"i": j, "x": source_rows(d).half(), "y": target_rows(d).half(), "T": d["ids"].numel()}
            if j < attn_prompts and "tgt_q" in d:
                it["q"] = d["tgt_q"]
            self.items.append(it)
        self.shifter, self.o_proj, self.skip = shifter, o_proj, skip_first
        self._true_attn = {}

    def score(self, predict, attn: bool = True, exact_sinks: bool = True) -> dict:
        """R² per target layer (K, V; pooled over held-out rows past the first ``skip_first``), the cosine of each
        layer's attention output (after o_proj; the target's own queries; mapped vs true K/V; sinks exact when
        ``exact_sinks``), and how the per-position error spreads."""
        sse = torch.zeros(LT, 2, dtype=torch.float64)
        ys, yss = torch.zeros(LT, 2, FT, dtype=torch.float64), torch.zeros(LT, 2, FT, dtype=torch.float64)
        nrows = 0
        cos = torch.zeros(LT, dtype=torch.float64)
        cos_pre = torch.zeros(LT, dtype=torch.float64)
        ncos = 0
        conc = {f: [] for f in ("top10", "top30", "top50")}
        conc_all = {f: [] for f in ("top10", "top30", "top50")}
        pos_err_layers = torch.zeros(LT, 2, dtype=torch.float64)
        for it in self.items:
            x, y, T = it["x"].float(), it["y"].float(), it["T"]
            pos = torch.arange(T)
            e_pos = torch.zeros(T, dtype=torch.float64)
            preds = []
            for t in range(LT):
                pk, pv = predict(x, t)
                yk, yv = y[:, t * 2 * FT:t * 2 * FT + FT], y[:, t * 2 * FT + FT:(t + 1) * 2 * FT]
                for kind, (p, yy) in enumerate(((pk, yk), (pv, yv))):
                    err = ((p - yy) ** 2).sum(-1).double()
                    e_pos += err / (yy * yy).sum(-1).double().mean()
                    r = slice(self.skip, T)
                    sse[t, kind] += err[r].sum()
                    ys[t, kind] += yy[r].double().sum(0)
                    yss[t, kind] += (yy[r].double() ** 2).sum(0)
                    pos_err_layers[t, kind] += (err / (yy * yy).sum(-1).double().mean())[r].sum()
                preds.append((pk, pv))
            nrows += T - self.skip
            for store, start in ((conc, self.skip), (conc_all, 0)):
                e = e_pos[start:].sort(descending=True).values
                tot = float(e.sum())
                for f, share in (("top10", 0.1), ("top30", 0.3), ("top50", 0.5)):
                    store[f].append(float(e[: max(1, round(share * len(e)))].sum()) / tot)
            if attn and "q" in it and self.shifter is not None:
                ncos += 1
                for t in range(LT):
                    q = rope(it["q"][t].float(), self.shifter, pos)
                    key = (it["i"], t)
                    yk, yv = y[:, t * 2 * FT:t * 2 * FT + FT], y[:, t * 2 * FT + FT:(t + 1) * 2 * FT]
                    if key not in self._true_attn:
                        self._true_attn[key] = attention(q, rope(yk, self.shifter, pos),
                                                         yv.reshape(T, 2, 128).transpose(0, 1)).half()
                    true = self._true_attn[key].float()
                    pk, pv = preds[t]
                    if exact_sinks:
                        pk, pv = pk.clone(), pv.clone()
                        pk[: self.skip], pv[: self.skip] = yk[: self.skip], yv[: self.skip]
                    mapped = attention(q, rope(pk, self.shifter, pos), pv.reshape(T, 2, 128).transpose(0, 1))
                    r = slice(self.skip, T)
                    cos_pre[t] += torch.nn.functional.cosine_similarity(mapped[r], true[r], dim=-1).mean()
                    if self.o_proj is not None:
                        w = self.o_proj[t]
                        cos[t] += torch.nn.functional.cosine_similarity(mapped[r] @ w.T, true[r] @ w.T, dim=-1).mean()
        sst = yss - ys * ys / nrows
        r2 = 1 - sse / sst.sum(-1)
        out = {"r2_k": r2[:, 0].tolist(), "r2_v": r2[:, 1].tolist(),
               "r2_k_mean": float(r2[:, 0].mean()), "r2_v_mean": float(r2[:, 1].mean()),
               "rows": nrows, "prompts": len(self.items),
               "error_share_worst": {f: sum(v) / len(v) for f, v in conc.items()},
               "error_share_worst_incl_sinks": {f: sum(v) / len(v) for f, v in conc_all.items()},
               "error_share_by_layer": (pos_err_layers.sum(1) / pos_err_layers.sum()).tolist()}
        if ncos:
            out["attn_cos_pre_oproj"] = (cos_pre / ncos).tolist()
            out["attn_cos_pre_oproj_mean"] = float((cos_pre / ncos).mean())
            if self.o_proj is not None:
                out["attn_cos"] = (cos / ncos).tolist()
                out["attn_cos_mean"] = float((cos / ncos).mean())
            out["attn_prompts"] = ncos
        return out
