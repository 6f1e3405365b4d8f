import torch, time, json
from hf_kvreuse.models import load_qwen
from hf_kvreuse.translation.mapper import MapperStats, PairGeometry, KVMapper, MapperConfig, _run_features, flat_features
from hf_kvreuse.translation.pairs import calibration_ids
from hf_kvreuse.model_check import require
from hf_kvreuse.rope import RopeShifter
torch.set_num_threads(2)
src, tok = load_qwen("0.5b"); tgt, _ = load_qwen("1.5b")
sc, tc = require(src, rope=True), require(tgt, rope=True)
g = PairGeometry(24, sc.kv_heads, sc.head_dim, 28, tc.kv_heads, tc.head_dim)
ss, ts = RopeShifter(src, layout=sc.rope_layout), RopeShifter(tgt, layout=tc.rope_layout)
ids = calibration_ids(tok, 96, 512)
calib, held = ids[:80], ids[80:]
stats = {s: MapperStats(g) for s in (1, 2)}
X_h, Y_h = [], []
t0 = time.time()
for i, c in enumerate(ids):
    c = c.reshape(1, -1)
    x = flat_features(_run_features(src, c, ss)); y = flat_features(_run_features(tgt, c, ts))
    if i < 80:
        for s, st in stats.items():
            if i < 64 or s == 1:
                keep = torch.arange(4, c.shape[1], s); st.add(x[keep], y[keep])
    else:
        X_h.append(x[4:]); Y_h.append(y[4:])
    if i % 10 == 0: print(i, time.time() - t0, flush=True)
X_h, Y_h = torch.cat(X_h), torch.cat(Y_h)
fs, ft = g.fs, g.ft
res = {}
for s, st in stats.items():
    for lam in (0.001, 0.01, 0.1, 1.0):
        m = KVMapper.from_stats(st, MapperConfig(top_k=8, ridge_lambda=lam))
        errs = {"k": [], "v": []}
        for t, lm in enumerate(m.layers):
            for kind, name in ((0, "k"), (1, "v")):
                xi = torch.cat([torch.arange((2 * s_ + kind) * fs, (2 * s_ + kind + 1) * fs) for s_ in lm.sources])
                yi = torch.arange((2 * t + kind) * ft, (2 * t + kind + 1) * ft)
                pred = X_h[:, xi] @ getattr(lm, f"w_{name}") + getattr(lm, f"b_{name}")
                y = Y_h[:, yi]
                errs[name].append(float(((pred - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()))
        key = f"stride{s}{'+80' if s == 1 else ''}_lam{lam}"
        res[key] = {"heldout_R2_k": 1 - sum(errs["k"]) / 28, "heldout_R2_v": 1 - sum(errs["v"]) / 28,
                    "insample_k": float(m.fit_r2[:, 0].mean()), "insample_v": float(m.fit_r2[:, 1].mean()), "rows": st.n}
        print(key, res[key], flush=True)
json.dump(res, open("/tmp/abl.json", "w"), indent=1)
