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
import contextlib
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..chunk_store import ChunkStore
from ..kv import KV
from .bridge import LatentBridge
from .example import Example


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
                 top_k: int, bridge_layer: int = -1, store: ChunkStore | None = None,
                 read_layers: tuple[int, ...] | None = None) -> Example:
    """Precompute one example: prompt ``x`` ``[1, N]`` whose block ``span`` is reused from under ``donor_prefix``,
    through the cache's own assembly (:class:`LatentRemedyCache`). ``read_layers`` (default ``(bridge_layer,)``):
    the layers whose hidden states of every prefix row are kept (``Example.feats``)."""
    from ..cache_classes.latent_remedy import LatentRemedyCache

    read_layers = tuple(read_layers) if read_layers is not None else (bridge_layer,)
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
    # student constants: prefix computed, donor block reused (direct reuse), the prefix's hidden states
    dummy = LatentBridge(model, n_latent=0, layers=read_layers, read="attn")
    cache = LatentRemedyCache(model, x, [span], bridge=dummy, store=store or ChunkStore(),
                              block_prefix_ids=donor_prefix)
    kv = cache.assemble_blocks()
    covered = kv[0][0].shape[-2]
    e = span[1]
    fresh = cache.fresh_rows(covered)
    pre = fresh[fresh < e]
    feats = cache.prefix_features(x[:, :covered], pre, kv)[0]  # [R, s, d]
    donor_feats = cache.donor_features()[0] if donor_prefix is not None and donor_prefix.numel() else None
    kv = [(k[..., :e, :].clone(), v[..., :e, :].clone()) for k, v in kv]
    full = torch.cat([x[0], ans[: keep - 1]])[None]
    h = feats[read_layers.index(-1) if -1 in read_layers else 0, -1:].float()
    return Example(kv, h, e, full[:, e:], x.shape[1] - 1 - e, top_idx, top_logp, s=span[0], feats=feats,
                   read_layers=read_layers, ids=full, donor_feats=donor_feats)


def student_logits(model, bridge: LatentBridge, ex: Example, tail_k: int = 0) -> torch.Tensor:
    """The student's logits ``[P, V]`` at the supervised positions (the first answer token, then the teacher's
    answer tokens), differentiable in the bridge: the same computation as
    :class:`~hf_kvreuse.cache_classes.latent_remedy.LatentRemedyCache` (latents after the block, positions shifted
    by ``n``), in one forward over latents + question + answer."""
    return student_logits_batch(model, bridge, [ex], tail_k=tail_k)[0]


def student_logits_batch(model, bridge: LatentBridge | None, exs: list[Example], tail_k: int = 0,
                         z: torch.Tensor | None = None) -> list[torch.Tensor]:
    """:func:`student_logits` of several examples in one padded forward (one GEMM of all their rows: on a CPU a
    forward of 8 x 25 rows costs about as much as three of 25).

    The examples' cached rows are left-padded to a common length, their input rows (the last ``tail_k`` block rows
    when recomputed, the latents, the question and answer) right-padded; a 2D mask hides the padding and each
    example keeps its own positions, so every example computes what it computes alone (tested).
    ``z`` ``[B, n, d]`` replaces the bridge's latents (free latents); ``bridge=None`` and no ``z``: direct reuse.
    """
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..kv import load_kv

    p = next(model.parameters())
    lora = bridge.lora_rank if bridge is not None and z is None else 0  # free latents run without the LoRA
    if z is None and bridge is not None and bridge.n_latent:
        z = bridge.latents(exs).to(p.device)
    n = 0 if z is None else z.shape[1]
    emb = model.get_input_embeddings()
    kept, inputs, poss = [], [], []
    for i, ex in enumerate(exs):
        k = min(tail_k, ex.e - max(ex.s, 1))
        c = ex.e - k
        ids = ex.ids if ex.ids is not None else None
        tail_rows = ids[:, c: ex.e] if k else ex.tail_ids[:, :0]
        parts = [emb(tail_rows.to(p.device))] if k else []
        if n:
            parts.append(z[i: i + 1].to(p.dtype))
        parts.append(emb(ex.tail_ids.to(p.device)))
        x = torch.cat(parts, 1)
        kept.append(c)
        inputs.append(x)
        poss.append(torch.cat([torch.arange(c, ex.e), torch.arange(ex.e, ex.e + n + ex.tail_ids.shape[1])]))
    B, C, T = len(exs), max(kept), max(x.shape[1] for x in inputs)
    kv = []
    for layer in range(len(exs[0].kv)):
        ks, vs = [], []
        for ex, c in zip(exs, kept):
            k_, v_ = ex.kv[layer]
            k_, v_ = k_[..., :c, :].to(device=p.device, dtype=p.dtype), v_[..., :c, :].to(device=p.device,
                                                                                            dtype=p.dtype)
            if c < C:
                pad = k_.new_zeros(*k_.shape[:-2], C - c, k_.shape[-1])
                k_, v_ = torch.cat([pad, k_], -2), torch.cat([pad, v_], -2)
            ks.append(k_)
            vs.append(v_)
        kv.append((torch.cat(ks, 0), torch.cat(vs, 0)))
    mask = torch.zeros(B, C + T, dtype=torch.long, device=p.device)
    x = inputs[0].new_zeros(B, T, inputs[0].shape[-1])
    pos = torch.zeros(B, T, dtype=torch.long)
    for i, (c, xi, pi) in enumerate(zip(kept, inputs, poss)):
        mask[i, C - c: C + xi.shape[1]] = 1
        x[i, : xi.shape[1]] = xi[0]
        pos[i, : xi.shape[1]] = pi
        if xi.shape[1] < T:  # padded rows continue the positions (finite, never attended to by real rows)
            pos[i, xi.shape[1]:] = pi[-1] + 1 + torch.arange(T - xi.shape[1])
    cache = load_kv(DynamicCache(config=model.config), kv)
    masks = mask if B > 1 or C + T > int(mask.sum()) else None
    on_latents = torch.zeros(B, T, dtype=torch.bool, device=p.device)  # where a LoRA bridge acts
    for i, c in enumerate(kept):
        on_latents[i, exs[i].e - c: exs[i].e - c + n] = True
    with bridge.lora_active(model, on_latents) if lora else contextlib.nullcontext():
        hidden = model.model(inputs_embeds=x, position_ids=pos.to(p.device), attention_mask=masks, use_cache=True,
                             **cache_kwargs(cache)).last_hidden_state
    out = []
    for i, (ex, c) in enumerate(zip(exs, kept)):
        start = (ex.e - c) + n + ex.first
        out.append(model.lm_head(hidden[i, start: start + ex.top_idx.shape[0]]))
    return out


def attach_focus_rows(tokenizer, exs: list[Example], k: int, window: int = 8) -> None:
    """Store in each example's ``meta["rows"]`` the ``k`` block rows FocusRecompute would recompute (focus rows
    against the donor prefix, then the tail; absolute indices), as
    :class:`~hf_kvreuse.cache_classes.latent_remedy.LatentRemedyCache` with ``focus=`` chooses them. The donor
    prefix of ``X -> Y`` is the own prefix of ``Y -> X`` (a record's two directions share a shard)."""
    from ..focus import focus_then_tail

    by_key = {(ex.meta.get("record"), ex.meta.get("direction")): ex for ex in exs}
    for ex in exs:
        src, _, tgt = str(ex.meta.get("direction", "")).partition("->")
        other = by_key.get((ex.meta.get("record"), f"{tgt}->{src}"))
        if other is None or ex.ids is None:
            raise ValueError(f"example {ex.meta.get('record')} {ex.meta.get('direction')}: no paired direction "
                             "(the donor prefix) to choose focus rows against")
        ids = ex.ids[0].tolist()
        rel, _ = focus_then_tail(tokenizer, ids[ex.s: ex.e], ids[: ex.s], other.ids[0, : other.s].tolist(), k,
                                 window)
        ex.meta["rows"] = (rel + ex.s).tolist()


def recompute_rows(ex: Example, k: int, kind: str) -> torch.Tensor:
    """The block rows recomputed with the latents: the last ``k`` (``"tail"``) or :func:`attach_focus_rows`'."""
    if kind == "focus":
        if "rows" not in ex.meta:
            raise ValueError("focus rows were not attached to the examples (attach_focus_rows)")
        return torch.tensor(ex.meta["rows"], dtype=torch.long)
    return torch.arange(ex.e - min(k, ex.e - max(ex.s, 1)), ex.e)


def _mask4d(row_pos: torch.Tensor, col_pos: torch.Tensor, col_valid: torch.Tensor, dtype) -> torch.Tensor:
    """``[B, 1, T, C]`` additive mask: row ``j`` sees column ``i`` iff it is valid and ``pos[i] <= pos[j]``."""
    ok = col_valid[:, None, :] & (col_pos[:, None, :] <= row_pos[:, :, None])
    return torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, torch.finfo(dtype).min)[:, None]


def student_logits_gated(model, bridge: LatentBridge | None, exs: list[Example],
                         rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The student with arbitrary recomputed block rows ``rows[i]`` (focus rows, or a tail), differentiable in the
    bridge, as :class:`~hf_kvreuse.cache_classes.latent_remedy.LatentRemedyCache` computes it:

    * a gated bridge, in two padded forwards: (1) the latents at positions ``e .. e+n-1`` after the prefix and the
      reused block (their states after every decoder layer kept); (2) the recomputed rows (their stale entries
      hidden), the question and the answer at their own positions, every row reading the latents through the
      bridge's read-out;
    * a bridge whose latents are rows: one forward over the recomputed rows, the latents (positions
      ``e .. e+n-1``) and the question and answer (positions shifted by ``n``);
    * ``bridge=None``: the recomputed rows alone (FocusRecompute / Tail-k, teacher-forced).

    Rows see columns by position (``pos[col] <= pos[row]``), as :func:`~hf_kvreuse.generation.partial.
    partial_forward` orders them; each example keeps its own positions (cached rows left-padded, input rows
    right-padded)."""
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..kv import load_kv

    p = next(model.parameters())
    emb = model.get_input_embeddings()
    B, C = len(exs), max(ex.e for ex in exs)
    kv, cpos, cvalid = [], torch.zeros(B, C, dtype=torch.long), torch.zeros(B, C, dtype=torch.bool)
    for i, ex in enumerate(exs):
        cpos[i, C - ex.e:] = torch.arange(ex.e)
        cvalid[i, C - ex.e:] = True
    for layer in range(len(exs[0].kv)):
        ks, vs = [], []
        for ex in exs:
            k_, v_ = (t[..., : ex.e, :].to(device=p.device, dtype=p.dtype) for t in ex.kv[layer])
            pad = k_.new_zeros(*k_.shape[:-2], C - ex.e, k_.shape[-1])
            ks.append(torch.cat([pad, k_], -2))
            vs.append(torch.cat([pad, v_], -2))
        kv.append((torch.cat(ks, 0), torch.cat(vs, 0)))
    gated = bridge is not None and bridge.gated
    states = None
    if gated:
        z = bridge.latents(exs).to(device=p.device, dtype=p.dtype)
        n = z.shape[1]
        zpos = torch.stack([torch.arange(ex.e, ex.e + n) for ex in exs])
        mask = _mask4d(zpos, torch.cat([cpos, zpos], 1), torch.cat([cvalid, torch.ones(B, n, dtype=torch.bool)], 1),
                       p.dtype)
        with bridge.capture_states(model) as states:
            model.model(inputs_embeds=z, position_ids=zpos.to(p.device), attention_mask=mask.to(p.device),
                        use_cache=True, **cache_kwargs(load_kv(DynamicCache(config=model.config), list(kv))))
    as_rows = bridge is not None and not gated and bridge.n_latent  # the latents are rows of this forward
    if as_rows and bridge.lora_rank:
        raise ValueError("a LoRA bridge with arbitrary recomputed rows is not supported by this student")
    zr = bridge.latents(exs).to(device=p.device, dtype=p.dtype) if as_rows else None
    shift = zr.shape[1] if as_rows else 0
    inputs, poss = [], []
    for i, (ex, r) in enumerate(zip(exs, rows)):
        r = r.to(torch.long)
        parts = [emb(ex.ids[:, r].to(p.device))] + ([zr[i: i + 1]] if as_rows else []) + \
            [emb(ex.tail_ids.to(p.device))]
        inputs.append(torch.cat(parts, 1))
        poss.append(torch.cat([r, torch.arange(ex.e, ex.e + shift + ex.tail_ids.shape[1])]))
    T = max(x.shape[1] for x in inputs)
    x = inputs[0].new_zeros(B, T, inputs[0].shape[-1])
    pos = torch.zeros(B, T, dtype=torch.long)
    ivalid = torch.zeros(B, T, dtype=torch.bool)
    cvalid_b = cvalid.clone()
    for i, (ex, r, xi, pi) in enumerate(zip(exs, rows, inputs, poss)):
        x[i, : xi.shape[1]] = xi[0]
        pos[i, : xi.shape[1]] = pi
        pos[i, xi.shape[1]:] = pi[-1] + 1 + torch.arange(T - xi.shape[1])
        ivalid[i, : xi.shape[1]] = True
        cvalid_b[i, C - ex.e + r.to(torch.long)] = False  # recomputed rows: their stale entries are hidden
    mask = _mask4d(pos, torch.cat([cpos, pos], 1), torch.cat([cvalid_b, ivalid], 1), p.dtype)
    cache = load_kv(DynamicCache(config=model.config), list(kv))
    with bridge.readout_active(model, states) if gated else contextlib.nullcontext():
        hidden = model.model(inputs_embeds=x, position_ids=pos.to(p.device), attention_mask=mask.to(p.device),
                             use_cache=True, **cache_kwargs(cache)).last_hidden_state
    out = []
    for i, (ex, r) in enumerate(zip(exs, rows)):
        start = r.numel() + shift + ex.first
        out.append(model.lm_head(hidden[i, start: start + ex.top_idx.shape[0]]))
    return out


def kl_top_k(logits: torch.Tensor, ex: Example, first_only: bool = False) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k support (renormalised), averaged over the positions."""
    if first_only:
        logits = logits[:1]
    logp = logits.float().log_softmax(-1)
    t_idx, t_logp = ex.top_idx[: len(logp)].to(logp.device), ex.top_logp[: len(logp)].float().to(logp.device)
    s_logp = logp.gather(-1, t_idx)
    s_logp = s_logp - s_logp.logsumexp(-1, keepdim=True)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


def student_loss(model, bridge: LatentBridge, ex: Example, first_only: bool = False) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k support, averaged over the supervised positions."""
    return kl_top_k(student_logits(model, bridge, ex), ex, first_only)


def batch_loss(model, bridge, exs: list[Example], tail_k: int = 0, z=None, first_only: bool = False,
               per_example: bool = False, rows: str = "tail"):
    """Mean (or per-example) :func:`kl_top_k` of a batch, in one padded forward (a gated bridge, or
    ``rows="focus"``: :func:`student_logits_gated`)."""
    if (bridge is not None and bridge.gated) or rows == "focus":
        if z is not None:
            raise ValueError("free latents (stage 1) are for bridges whose latents are cache rows")
        logits = student_logits_gated(model, bridge, exs, [recompute_rows(ex, tail_k, rows) for ex in exs])
    else:
        logits = student_logits_batch(model, bridge, exs, tail_k=tail_k, z=z)
    losses = torch.stack([kl_top_k(lg, ex, first_only) for lg, ex in zip(logits, exs)])
    return losses if per_example else losses.mean()


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


@dataclass
class TrainConfig:
    """Hyperparameters of one training run (bridge shape, the three stages, the CPU budget)."""

    n_latent: int = 8
    hidden: int = 256
    layers: tuple = (-1,)
    read: str = "last"                  # "last" or "attn" (attention-pooled prefix rows as well)
    tail_tokens: int = 0                # latents plus Tail-k: block rows recomputed with the latents
    lora_rank: int = 0                  # RestoreKV's bridge: a LoRA active on the latent rows (0: none)
    lora_lr: float = 1e-3               # its stage-3 learning rate
    donor: bool = False                 # the bridge also reads the donor's prefix (an ablation)
    readout: str = "tokens"             # "gated": latents read through the zero-initialised cross-attention
    readout_rank: int = 32
    readout_lr: float = 2e-4            # the gated read-out's AdamW rate (its first steps move every weight by ~lr)
    rows: str = "tail"                  # "focus": FocusRecompute's rows recomputed beside the latents
    lr: float = 2e-3                    # stage 3 (distillation) AdamW
    batch: int = 8
    loss: str = "continuation"          # or "first": only the first answer token
    seed: int = 0
    stage1_examples: int = 0            # 0: no amortised stages (distillation from scratch)
    stage1_steps: int = 12              # Adam steps on each example's free latents
    stage1_lr: float = 2e-2
    stage2_steps: int = 400             # full-batch regression of the bridge onto the free latents
    stage2_lr: float = 1e-3
    budget_cpu_s: float = 1800.0        # this process's CPU seconds for all stages (data loading excluded)
    max_steps: int = 0                  # stage 3 stops here too (0: no limit)
    save_every: int = 25


def _cpu() -> float:
    # this thread's CPU seconds: with one intra-op thread the work runs in the calling thread, and several runs
    # may share a process (research/latent/latent_ablations_threads.py)
    return time.thread_time()


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def free_latents(model, bridge: LatentBridge, exs: list[Example], cfg: TrainConfig) -> tuple[torch.Tensor, list]:
    """Stage 1: per example, ``n`` free latent vectors (initialised at the bridge's current output) optimised with
    Adam on the distillation loss (a batch of examples at once, each its own vectors). Returns ``z`` ``[B, n, d]``
    and the per-example loss before / after."""
    with torch.no_grad():
        z0 = bridge.latents(exs)
    z = z0.clone().requires_grad_(True)
    opt = torch.optim.Adam([z], lr=cfg.stage1_lr)
    first = None
    for _ in range(cfg.stage1_steps):
        losses = batch_loss(model, None, exs, cfg.tail_tokens, z=z, first_only=cfg.loss == "first",
                            per_example=True)
        first = losses.detach() if first is None else first
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        opt.step()
    with torch.no_grad():
        last = batch_loss(model, None, exs, cfg.tail_tokens, z=z, first_only=cfg.loss == "first", per_example=True)
    return z.detach(), list(zip(first.tolist(), last.tolist()))


def regress(bridge: LatentBridge, exs: list[Example], z: torch.Tensor, cfg: TrainConfig) -> list[float]:
    """Stage 2: fit the bridge to the free latents (mean squared error relative to their spread)."""
    opt = torch.optim.AdamW(bridge.parameters(), lr=cfg.stage2_lr, weight_decay=1e-4)
    spread = float(((z - z.mean(0, keepdim=True)) ** 2).mean()) + 1e-8
    curve = []
    for i in range(cfg.stage2_steps):
        pred = bridge.latents(exs)
        loss = ((pred - z) ** 2).mean() / spread
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 50 == 0 or i == cfg.stage2_steps - 1:
            curve.append(round(float(loss.detach()), 4))
    return curve


@torch.no_grad()
def evaluate_rows(model, bridge: LatentBridge | None, exs: list[Example], tail_k: int = 0, batch: int = 8,
                  rows: str = "tail") -> list[dict]:
    """Per example, teacher-forced (no generation): ``agree`` = the student's argmax equals the teacher's answer
    at every supervised position (its greedy answer would be the full prefill's), ``ok`` = agree and the teacher is
    right, ``reuse_ok`` the same for direct reuse (stored with the example), ``kl`` the loss."""
    out = []
    for i in range(0, len(exs), batch):
        chunk = exs[i: i + batch]
        if (bridge is not None and bridge.gated) or rows == "focus":
            logits = student_logits_gated(model, bridge, chunk, [recompute_rows(ex, tail_k, rows) for ex in chunk])
        else:
            logits = student_logits_batch(model, bridge, chunk, tail_k=tail_k)
        for lg, ex in zip(logits, chunk):
            agree = bool((lg.argmax(-1) == ex.top_idx[:, 0]).all())
            full_ok = bool(ex.meta.get("full_ok", True))
            out.append({"family": ex.meta.get("family", "?"), "record": ex.meta.get("record"),
                        "direction": ex.meta.get("direction"), "agree": agree, "full_ok": full_ok,
                        "ok": full_ok and agree, "reuse_ok": full_ok and bool(ex.meta.get("reuse_agree", False)),
                        "kl": round(float(kl_top_k(lg, ex)), 5)})
    return out


def summarize_rows(rows: list[dict]) -> dict:
    """Per family and ``all``: ``full_acc``, ``acc``, ``reuse_acc``, ``agree``, ``recovered`` =
    ``(acc - reuse_acc) / (full_acc - reuse_acc)``, ``kl``."""
    out = {}
    for fam in sorted({r["family"] for r in rows}) + ["all"]:
        sel = [r for r in rows if fam == "all" or r["family"] == fam]
        n = len(sel)
        full = sum(r["full_ok"] for r in sel) / n
        acc = sum(r["ok"] for r in sel) / n
        reuse = sum(r["reuse_ok"] for r in sel) / n
        out[fam] = {"n": n, "full_acc": full, "acc": acc, "reuse_acc": reuse, "agree": sum(r["agree"] for r in sel) / n,
                    "recovered": (acc - reuse) / (full - reuse) if full > reuse else float("nan"),
                    "kl": sum(r["kl"] for r in sel) / n}
    return out


def evaluate(model, bridge: LatentBridge | None, exs: list[Example], tail_k: int = 0, batch: int = 8) -> dict:
    """Teacher-forced figures per family on precomputed examples (:func:`evaluate_rows`, :func:`summarize_rows`)."""
    return summarize_rows(evaluate_rows(model, bridge, exs, tail_k, batch))


def _save_state(out: Path, bridge: LatentBridge, opt, state: dict) -> None:
    bridge.save(out, dtype=torch.float32)
    if opt is not None:
        _save_trainer(out, opt, state["step"], state)
    (out / "state.json").write_text(json.dumps(state, indent=1, default=str))


_INIT_LOCK = threading.Lock()


def _initial_bridge(model, out: Path, cfg: TrainConfig, conf: dict, state_path: Path) -> LatentBridge:
    if state_path.exists():
        # a run saved before a field existed ran with its default
        old = {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(TrainConfig()).items()},
               **json.loads(state_path.read_text())["config"]}
        if {k: v for k, v in old.items() if k not in ("budget_cpu_s", "max_steps")} != \
                {k: v for k, v in conf.items() if k not in ("budget_cpu_s", "max_steps")}:
            raise ValueError(f"{out} holds a run with another configuration ({old}); use another --out")
        return LatentBridge.load(out, model)
    return LatentBridge(model, cfg.n_latent, cfg.hidden, layers=tuple(cfg.layers), read=cfg.read,
                        tail_tokens=cfg.tail_tokens, lora_rank=cfg.lora_rank, donor=cfg.donor, readout=cfg.readout,
                        readout_rank=cfg.readout_rank, rows=cfg.rows)


def train_staged(model, data: list[Example], out: str | Path, cfg: TrainConfig, progress: bool = True,
                 stop_at: float | None = None) -> LatentBridge:
    """Train (or resume) a bridge on precomputed examples (:mod:`hf_kvreuse.latent.data`) within
    ``cfg.budget_cpu_s`` CPU seconds: stage 1 free latents on ``cfg.stage1_examples`` examples, stage 2 regression
    of the bridge onto them, stage 3 distillation (batches of ``cfg.batch``) until the budget is spent.
    ``out`` holds the bridge, the optimiser state and ``state.json`` (stage, step, CPU seconds spent); rerunning
    resumes. With ``stage1_examples=0`` it is distillation from scratch. ``stop_at`` (``time.time()``): stage 3
    also stops at this wall-clock time (a shared machine; rerun to continue)."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    conf = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    state_path = out / "state.json"
    with _INIT_LOCK:  # the seed and the bridge's initialisation together (runs may share a process)
        torch.manual_seed(cfg.seed)
        bridge = _initial_bridge(model, out, cfg, conf, state_path)
    if state_path.exists():
        state = json.loads(state_path.read_text())
        state["config"] = conf
    else:
        state = {"config": conf, "stage": 1 if cfg.stage1_examples else 3, "step": 0, "cpu_s": 0.0,
                 "stage_cpu_s": {}, "losses": [], "stage1": [], "stage2": [], "train_examples": len(data),
                 "git_commit": _git_commit()}
    for p in model.parameters():
        p.requires_grad_(False)
    rng = random.Random(cfg.seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    budget = cfg.budget_cpu_s

    def spend(stage: str, t0: float) -> None:
        dt = _cpu() - t0
        state["cpu_s"] += dt
        state["stage_cpu_s"][stage] = state["stage_cpu_s"].get(stage, 0.0) + dt

    if state["stage"] == 1:  # free latents, saved chunk by chunk (resumable)
        sel = order[: cfg.stage1_examples]
        zfile = out / "stage1.safetensors"
        from safetensors.torch import load_file, save_file

        done = load_file(str(zfile)) if zfile.exists() else {}
        bar = tqdm(total=len(sel), initial=len(done), desc="stage 1: free latents", disable=not progress)
        for i in range(0, len(sel), cfg.batch):
            keys = [str(j) for j in sel[i: i + cfg.batch]]
            if all(k in done for k in keys):
                continue
            t0 = _cpu()
            z, ls = free_latents(model, bridge, [data[j] for j in sel[i: i + cfg.batch]], cfg)
            done.update({k: z[m].contiguous() for m, k in enumerate(keys)})
            state["stage1"].extend([round(a, 4), round(b, 4)] for a, b in ls)
            save_file(done, str(zfile))
            spend("stage1", t0)
            _save_state(out, bridge, None, state)
            bar.update(len(keys))
        bar.close()
        state["stage"] = 2
    if state["stage"] == 2:
        from safetensors.torch import load_file

        t0 = _cpu()
        done = load_file(str(out / "stage1.safetensors"))
        keys = sorted(done, key=int)
        state["stage2"] = regress(bridge, [data[int(k)] for k in keys], torch.stack([done[k] for k in keys]), cfg)
        spend("stage2", t0)
        state["stage"] = 3
        _save_state(out, bridge, None, state)
    lora = [prm for name, prm in bridge.named_parameters() if name.startswith("lora.")]
    gate = [prm for name, prm in bridge.named_parameters() if name.startswith("gate.")]
    rest = [prm for name, prm in bridge.named_parameters() if not name.startswith(("lora.", "gate."))]
    groups = [{"params": rest}] + ([{"params": lora, "lr": cfg.lora_lr}] if lora else []) + \
        ([{"params": gate, "lr": cfg.readout_lr}] if gate else [])
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    if (out / "trainer.json").exists() and state["step"] > 0:
        _load_trainer(out, opt)
    bar = tqdm(initial=state["step"], desc="stage 3: distillation", disable=not progress)
    while state["cpu_s"] < budget and (not cfg.max_steps or state["step"] < cfg.max_steps) and \
            (stop_at is None or time.time() < stop_at):
        t0 = _cpu()
        per_epoch = max(1, len(data) // cfg.batch)
        epoch, pos = divmod(state["step"], per_epoch)
        perm = list(range(len(data)))
        random.Random(cfg.seed * 7919 + epoch).shuffle(perm)
        exs = [data[j] for j in perm[pos * cfg.batch: (pos + 1) * cfg.batch]]
        loss = batch_loss(model, bridge, exs, cfg.tail_tokens, first_only=cfg.loss == "first", rows=cfg.rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bridge.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["losses"].append(round(float(loss.detach()), 4))
        spend("stage3", t0)
        bar.update(1)
        bar.set_postfix(loss=f"{statistics_mean(state['losses'][-20:]):.3f}", cpu=f"{state['cpu_s']:.0f}s")
        if state["step"] % cfg.save_every == 0:
            bridge.info = {"config": conf, "step": state["step"], "cpu_s": state["cpu_s"]}
            _save_state(out, bridge, opt, state)
    bar.close()
    bridge.info = {"config": conf, "step": state["step"], "cpu_s": state["cpu_s"],
                   "stage_cpu_s": state["stage_cpu_s"], "train_examples": len(data),
                   "loss_last20": statistics_mean(state["losses"][-20:]), "git_commit": state.get("git_commit")}
    _save_state(out, bridge, opt, state)
    return bridge


def statistics_mean(xs) -> float:
    return sum(xs) / max(1, len(xs))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_kvreuse.latent.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b", help="offline model name (smollm2, qwen2.5-0.5b, ...)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--data", required=True, help="folder of training shards (python -m hf_kvreuse.latent.data)")
    p.add_argument("--families", nargs="+", default=None, help="training families (default: every shard)")
    p.add_argument("--max-per-family", type=int, default=None)
    p.add_argument("--dev", default=None, help="folder of dev shards, evaluated at the end (teacher-forced)")
    p.add_argument("--out", required=True, help="the run folder (bridge, optimiser, state; rerun to resume)")
    p.add_argument("--result", default=None, help="JSON with config, seed, git commit, CPU seconds, dev figures")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "layers":
            p.add_argument(flag, type=int, nargs="+", default=list(f.default))
        elif isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    p.add_argument("--focus-window", type=int, default=8, help="with --rows focus: FocusRecompute's window")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", nargs="*", default=[],
                   help="NAME=PATH (or shipped): other bridges evaluated on the dev shards too (e.g. the shipped one)")
    p.add_argument("--baseline-tail", type=int, default=16, help="Tail-k baseline evaluated on the dev shards")
    p.add_argument("--stop-at-wall", type=float, default=None,
                   help="stage 3 stops at this wall-clock time (seconds since the epoch); rerun to continue")
    return p


def run(argv, model=None, loaded: dict | None = None, tokenizer=None) -> dict:
    """One training command (see :func:`main`); ``model`` and ``loaded`` (data folder -> examples) may be shared
    by several runs in one process (``research/latent/latent_ablations_threads.py``: one model copy in memory)."""
    from .example import load_examples

    a = _parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: (tuple(getattr(a, f.name)) if f.name == "layers" else getattr(a, f.name))
                         for f in fields(TrainConfig)})
    if model is None:
        from ..generation.mixin import enable
        from ..models import load_offline

        torch.set_num_threads(a.threads)
        model, _ = load_offline(a.model, dtype=getattr(torch, a.dtype))
        enable(model)
    loaded = {} if loaded is None else loaded
    key = (a.data, tuple(a.families or ()), a.max_per_family)
    if key not in loaded:
        loaded[key] = load_examples(a.data, a.families, a.max_per_family)
    data = loaded[key]
    if cfg.rows == "focus":
        if tokenizer is None:
            from transformers import AutoTokenizer

            from ..models.loaders import model_path

            tokenizer = AutoTokenizer.from_pretrained(model_path(a.model))
        attach_focus_rows(tokenizer, data, cfg.tail_tokens, a.focus_window)
    t0 = time.perf_counter()
    bridge = train_staged(model, data, a.out, cfg, progress=len(loaded) <= 1, stop_at=a.stop_at_wall)
    wall = time.perf_counter() - t0
    res = {"command": "python -m hf_kvreuse.latent.train " + " ".join(argv),
           "config": asdict(cfg), "families": sorted({ex.meta.get("family") for ex in data}),
           "train_examples": len(data), "bridge": bridge.info, "wall_s_this_run": wall, "date": time.strftime("%F %T")}
    if a.dev:
        if a.dev not in loaded:
            loaded[a.dev] = load_examples(a.dev)
        dev = loaded[a.dev]
        if cfg.rows == "focus":
            attach_focus_rows(tokenizer, dev, cfg.tail_tokens, a.focus_window)
        c0 = _cpu()
        # per example and variant, so that a table can pair them (Newcombe intervals of paired differences)
        rows = {"bridge": evaluate_rows(model, bridge, dev, cfg.tail_tokens, cfg.batch, cfg.rows),
                "reuse": evaluate_rows(model, None, dev, 0, cfg.batch)}
        if cfg.rows == "focus":  # the rows alone, no latents: what the bridge must add to
            rows[f"focus{cfg.tail_tokens}"] = evaluate_rows(model, None, dev, cfg.tail_tokens, cfg.batch, "focus")
        if cfg.tail_tokens:
            rows[f"tail{cfg.tail_tokens}"] = evaluate_rows(model, None, dev, cfg.tail_tokens, cfg.batch)
        if a.baseline_tail and f"tail{a.baseline_tail}" not in rows:
            rows[f"tail{a.baseline_tail}"] = evaluate_rows(model, None, dev, a.baseline_tail, cfg.batch)
        res["compare"] = {}
        for spec in a.compare:
            name, path = spec.split("=", 1) if "=" in spec else (spec, spec)
            other = LatentBridge.from_pretrained(model, None if path == "shipped" else path)
            rows[name] = evaluate_rows(model, other, dev, other.tail_tokens, cfg.batch, other.rows)
            res["compare"][name] = {"path": path, "n_latent": other.n_latent, "tail_tokens": other.tail_tokens,
                                    "info": other.info}
        res["dev"] = summarize_rows(rows["bridge"])
        res["dev_reuse"] = summarize_rows(rows["reuse"])
        res["dev_reuse_tail"] = summarize_rows(rows[f"tail{cfg.tail_tokens}"]) if cfg.tail_tokens else None
        res["dev_variants"] = {k: summarize_rows(v) for k, v in rows.items()}
        res["dev_rows"] = rows
        res["dev_cpu_s"] = _cpu() - c0
    if a.result:
        Path(a.result).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result).write_text(json.dumps(res, indent=1, default=str))
    return res


def main(argv=None) -> None:
    """Train a bridge on precomputed shards (resumable), optionally evaluate it on dev shards and write a result
    JSON (config, seed, git commit, CPU seconds per stage, dev figures)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    res = run(argv)
    print(json.dumps({k: v for k, v in res.items() if k in ("bridge", "dev")}, indent=1, default=str))

if __name__ == "__main__":
    main()
