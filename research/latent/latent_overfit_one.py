"""Can free latent vectors flip one conflicting answer? Optimise 8 latent embeddings (no MLP) on one retrieval
example of Qwen2.5-Coder-0.5B with the first-token KL (README, LatentRemedy: "what was tried").

    python research/latent/latent_overfit_one.py
"""
import torch, time
from hf_kvreuse import enable, LatentBridge
from hf_kvreuse.models import load_qwen
from hf_kvreuse.latent.train import build_example, student_loss, student_logits
from hf_kvreuse.workflows import conflict_records
torch.set_num_threads(1)
m, tok = load_qwen("0.5b"); enable(m)
for p in m.parameters(): p.requires_grad_(False)
rec = conflict_records("retrieval", 3, seed=5)[0]
ex = build_example(m, tok, rec, "a", "b", 4, 32, -1)
print("gold b", rec.gold_b, "teacher top", tok.decode(ex.top_idx[0, :3]))
for lr, scale in [(1e-2, 1.0), (5e-2, 1.0)]:
    br = LatentBridge(m, n_latent=8, hidden=64)
    opt = torch.optim.Adam([br.base], lr=lr)
    t=time.time()
    for i in range(60):
        l = student_loss(m, br, ex, first_only=True); opt.zero_grad(); l.backward(); opt.step()
        if i % 15 == 0 or i == 59:
            with torch.no_grad(): top = student_logits(m, br, ex)[0].argmax()
            print(lr, i, round(float(l), 3), repr(tok.decode(top)), round(float(br.base.norm(dim=-1).mean()), 3), time.time()-t, flush=True)
