"""Full-prefill distillation of a LatentBridge (LatentRemedy, seed 003; METHODS.md §2.2), LLM frozen.

For each training example (a conflicting-task record, a direction X -> Y):

* **teacher**: agent Y's full prefill of its own prompt, then its greedy answer ``c`` (teacher-forced below);
  kept are the teacher's top-``top_k`` log-probabilities at the answer's first token and (``--loss continuation``)
  at every token of ``c``;
* **student**: Y's prefix computed, the block K/V that X computed under its prefix moved into place (direct
  reuse), then the bridge's latents, then Y's question and ``c``, in one differentiable forward over the
  latents + question + answer (the prefix and block K/V are constants);
* loss: ``KL(teacher || student)`` over the teacher's top-``k`` support (renormalised), averaged over positions.

Only the bridge is trained; the student's constant parts are computed once per example. Resumable: ``--out``
holds ``bridge.safetensors`` / ``bridge.json`` (the checkpoint) and ``trainer.safetensors`` / ``trainer.json``
(optimizer state, step, RNG state), written every ``--save-every`` steps; running the same command again resumes.

    python -m hf_kvreuse.latent.train --model qwen2.5-0.5b --out hf_kvreuse/latent/checkpoints/qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..chunk_store import ChunkStore
from ..kv import KV
from .bridge import LatentBridge


@dataclass
class Example:
    """Constants of one (record, direction): the student's cached prefix+block and the teacher's targets."""

    kv: KV                    # prefix + reused block K/V, rows 0..e-1
    h: torch.Tensor           # [1, d] the prefix's last hidden state
    e: int                    # where the latents go
    tail_ids: torch.Tensor    # [1, m] question (+ assistant header) + teacher answer tokens but the last
    first: int                # index in tail_ids of the last prompt token (its logits give the first answer token)
    top_idx: torch.Tensor     # [P, k] teacher top-k token ids at the supervised positions
    top_logp: torch.Tensor    # [P, k] teacher log-probs there (renormalised over the top-k)


def build_example(model, tok, record, src: str, tgt: str, n_answer: int, top_k: int, bridge_layer: int,
                  store: ChunkStore | None = None) -> Example:
    """Precompute one example of a conflicting-task record, direction ``src -> tgt``."""
    from ..workflows.conflicting import prompt_parts

    ids, span = prompt_parts(tok, record, tgt)
    donor, (ds, _) = prompt_parts(tok, record, src)
    return make_example(model, torch.tensor([ids]), span, torch.tensor(donor[:ds]), n_answer, top_k, bridge_layer,
                        store)


@torch.no_grad()
def make_example(model, x: torch.Tensor, span: tuple[int, int], donor_prefix: torch.Tensor, n_answer: int,
                 top_k: int, bridge_layer: int = -1, store: ChunkStore | None = None) -> Example:
    """Precompute one example: prompt ``x`` ``[1, N]`` whose block ``span`` is reused from under ``donor_prefix``."""
    from ..cache_classes.latent_remedy import LatentRemedyCache

    # teacher: full prefill + greedy answer
    out = model.generate(x, max_new_tokens=n_answer, do_sample=False, return_dict_in_generate=True,
                         output_logits=True)
    ans = out.sequences[0, x.shape[1]:]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    keep = len(ans)
    for i, t in enumerate(ans.tolist()):
        if t in eos:
            keep = i + 1
            break
    logits = torch.stack(out.logits[:keep], dim=1)[0].float()  # [P, V]
    logp = logits.log_softmax(-1)
    top_logp, top_idx = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    top_logp = top_logp - top_logp.logsumexp(-1, keepdim=True)
    # student constants: prefix computed, donor block reused (direct reuse), h from the prefix
    dummy = LatentBridge(model, n_latent=0, hidden_layer=bridge_layer)
    cache = LatentRemedyCache(model, x, [span], bridge=dummy, store=store or ChunkStore(),
                              block_prefix_ids=donor_prefix)
    kv = cache.assemble_blocks()
    covered = kv[0][0].shape[-2]
    e = span[1]
    fresh = cache.fresh_rows(covered)
    pre = fresh[fresh < e]
    h = cache.prefix_hidden(x[:, :covered], pre, kv)
    kv = [(k[..., :e, :].clone(), v[..., :e, :].clone()) for k, v in kv]
    tail = torch.cat([x[0, e:], ans[: keep - 1]])[None]
    return Example(kv, h.float(), e, tail, x.shape[1] - 1 - e, top_idx, top_logp)


def student_logits(model, bridge: LatentBridge, ex: Example) -> torch.Tensor:
    """The student's logits ``[P, V]`` at the supervised positions (the first answer token, then the teacher's
    answer tokens), differentiable in the bridge: the same computation as
    :class:`~hf_kvreuse.cache_classes.latent_remedy.LatentRemedyCache` (latents after the block, positions shifted
    by ``n``), in one forward over latents + question + answer."""
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..kv import load_kv

    p = next(model.parameters())
    n = bridge.n_latent
    z = bridge(ex.h.to(p.device)).to(p.dtype)                              # [1, n, d]
    emb = model.get_input_embeddings()(ex.tail_ids.to(p.device))          # [1, m, d]
    inputs = torch.cat([z, emb], dim=1)
    pos = torch.arange(ex.e, ex.e + inputs.shape[1], device=p.device)[None]
    cache = load_kv(DynamicCache(config=model.config), list(ex.kv))       # update() concatenates: ex.kv intact
    out = model(inputs_embeds=inputs, position_ids=pos, use_cache=True, **cache_kwargs(cache))
    rows = torch.arange(ex.first, ex.first + ex.top_idx.shape[0], device=p.device) + n
    return out.logits[0, rows]


def student_loss(model, bridge: LatentBridge, ex: Example, first_only: bool = False) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k support, averaged over the supervised positions."""
    logits = student_logits(model, bridge, ex)
    if first_only:
        logits = logits[:1]
    logp = logits.float().log_softmax(-1)
    t_idx, t_logp = ex.top_idx[: len(logp)].to(logp.device), ex.top_logp[: len(logp)].to(logp.device)
    s_logp = logp.gather(-1, t_idx)
    s_logp = s_logp - s_logp.logsumexp(-1, keepdim=True)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


def _save_trainer(out: Path, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, prm in enumerate(group["params"]):
            for key, val in opt.state.get(prm, {}).items():
                if torch.is_tensor(val):
                    tensors[f"{gi}.{pi}.{key}"] = val.detach().contiguous()
    save_file(tensors, str(out / "trainer.safetensors"))
    (out / "trainer.json").write_text(json.dumps({"step": step, **extra}, indent=1))


def _load_trainer(out: Path, opt: torch.optim.Optimizer) -> int:
    from safetensors.torch import load_file

    meta = json.loads((out / "trainer.json").read_text())
    tensors = load_file(str(out / "trainer.safetensors"))
    for gi, group in enumerate(opt.param_groups):
        for pi, prm in enumerate(group["params"]):
            st = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{gi}.{pi}.")}
            if st:
                opt.state[prm] = st
    return int(meta["step"])


def train(model, tok, out: str | Path, families=None, n_records: int = 64, steps: int = 300, lr: float = 2e-3,
          n_latent: int = 8, hidden: int = 256, hidden_layer: int = -1, n_answer: int = 4, top_k: int = 32,
          loss: str = "continuation", seed: int = 0, save_every: int = 50, progress: bool = True,
          record_seed: int = 0) -> LatentBridge:
    """Train (or resume) a bridge; returns it. See the module docstring."""
    from tqdm.auto import tqdm

    from ..workflows.conflicting import TRAIN_FAMILIES, conflict_records

    families = tuple(families or TRAIN_FAMILIES)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    random.seed(seed)
    config = {"families": families, "n_records": n_records, "steps": steps, "lr": lr, "n_latent": n_latent,
              "hidden": hidden, "hidden_layer": hidden_layer, "n_answer": n_answer, "top_k": top_k, "loss": loss,
              "seed": seed, "record_seed": record_seed}
    resume = (out / "trainer.json").exists() and (out / "bridge.json").exists()
    bridge = LatentBridge.load(out, model) if resume else LatentBridge(model, n_latent, hidden, hidden_layer)
    if resume:
        old = json.loads((out / "trainer.json").read_text()).get("config", {})
        if {k: v for k, v in old.items() if k != "steps"} != {k: (list(v) if isinstance(v, tuple) else v)
                                                             for k, v in config.items() if k != "steps"}:
            raise ValueError(f"{out} holds a run with another configuration ({old}); use another --out")
    opt = torch.optim.AdamW(bridge.parameters(), lr=lr, weight_decay=0.0)
    step = _load_trainer(out, opt) if resume else 0
    t0 = time.perf_counter()
    examples = []
    store = ChunkStore()
    recs = [r for fam in families for r in conflict_records(fam, n_records, seed=record_seed)]
    for rec in tqdm(recs, desc="teacher + student constants", disable=not progress):
        for src, tgt in (("a", "b"), ("b", "a")):
            examples.append(build_example(model, tok, rec, src, tgt, n_answer, top_k, hidden_layer, store))
    prep_s = time.perf_counter() - t0
    for p in model.parameters():
        p.requires_grad_(False)
    rng = random.Random(seed * 1000 + step)  # the example order depends on the step: resuming continues it
    bar = tqdm(total=steps, initial=step, desc="distill", disable=not progress)
    losses = []
    t1 = time.perf_counter()
    while step < steps:
        ex = examples[rng.randrange(len(examples))]
        lval = student_loss(model, bridge, ex, first_only=(loss == "first"))
        opt.zero_grad(set_to_none=True)
        lval.backward()
        torch.nn.utils.clip_grad_norm_(bridge.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(float(lval))
        bar.update(1)
        bar.set_postfix(loss=f"{statistics_mean(losses[-20:]):.3f}")
        if step % save_every == 0 or step == steps:
            bridge.info = {"config": config, "step": step, "train_examples": len(examples),
                           "loss_last20": statistics_mean(losses[-20:]), "prep_s": prep_s,
                           "train_s": time.perf_counter() - t1}
            bridge.save(out)
            _save_trainer(out, opt, step, {"config": config})
    bar.close()
    return bridge


def statistics_mean(xs) -> float:
    return sum(xs) / max(1, len(xs))


def main(argv=None) -> None:
    from ..models import load_offline

    p = argparse.ArgumentParser(prog="python -m hf_kvreuse.latent.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b", help="offline model name (smollm2, qwen2.5-0.5b, ...)")
    p.add_argument("--out", required=True)
    p.add_argument("--families", nargs="+", default=None)
    p.add_argument("--n-records", type=int, default=64, help="records per family (two directions each)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--n-latent", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--hidden-layer", type=int, default=-1)
    p.add_argument("--n-answer", type=int, default=4, help="teacher answer tokens supervised (teacher-forced)")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--loss", choices=["continuation", "first"], default="continuation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = torch.float32 if "smollm2" in a.model else torch.bfloat16
    model, tok = load_offline(a.model, dtype=dtype)
    from ..generation.mixin import enable

    enable(model)
    t0 = time.perf_counter()
    bridge = train(model, tok, a.out, a.families, a.n_records, a.steps, a.lr, a.n_latent, a.hidden, a.hidden_layer,
                   a.n_answer, a.top_k, a.loss, a.seed, a.save_every)
    print(f"trained {bridge} in {time.perf_counter() - t0:.0f} s; saved to {a.out}: {bridge.info}")


if __name__ == "__main__":
    main()
