"""Output-level fitting of a :class:`~hf_kvreuse.translation.KVMapper`.

The closed-form maps minimise the K/V reconstruction error, which is not what decides the answers (the K/V-error
oracle retains 62% at a 30% recompute budget, research notes: TranslatedCache). Here the maps start from
that closed form and are fine-tuned so that the *frozen* target, reading the mapped cache, predicts what its own
full prefill predicts: the KL divergence from the full prefill's next-token distribution to the mapped cache's,
on the teacher's greedy answer tokens of calibration prompts (teacher forcing). KV Prediction (Horton et al. 2024,
arXiv 2410.08391) trains its KV predictor through the base model's outputs in the same way; RaReCache's maps are
closed-form only.

Algorithm (:func:`fit_outputs`)::

    for every calibration prompt x (length T, cached rows 0..n-1, n = T - 1):
        teacher: full prefill of x + greedy answer a_1..a_m  ->  log p(. | x, a_<j)  for j = 1..m
        source features: the source's RoPE-stripped K/V of x[:n] (constant)
    repeat for `epochs`:
        for every prompt (shuffled):
            K/V = maps(source features), target RoPE applied at 0..n-1     # differentiable in the maps
            student = target([x_n, a_1..a_{m-1}] at n.., past = K/V)       # the frozen target
            loss = mean_j KL(teacher_j || student_j)  (+ anchor * ||W - W0||^2 / ||W0||^2)
            Adam step on every layer's w_k, b_k, w_v, b_v
    keep the maps of the epoch with the lowest validation KL (held-out prompts), if given

The result is a :class:`KVMapper` of the same kind and format (save / load / identity check unchanged); its
``info["output_fit"]`` records the configuration and the KL history. The rank scorer's output statistics stay those
of the closed form (the first-layer scorer, the default, does not read them).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from .mapper import KVMapper, content_features


@dataclass
class OutputFitConfig:
    """Hyperparameters of :func:`fit_outputs`.

    Parameters
    ----------
    answer_tokens : int, default=8
        Teacher answer tokens per prompt (the KL is taken at each of them).
    epochs : int, default=4
        Passes over the calibration prompts.
    lr : float, default=1e-4
        Adam learning rate of the map weights and biases.
    anchor : float, default=0.0
        Weight of the relative squared distance to the closed-form weights (0: none).
    seed : int, default=0
        Order of the prompts.
    """

    answer_tokens: int = 8
    epochs: int = 4
    lr: float = 1e-4
    anchor: float = 0.0
    seed: int = 0


@dataclass
class FitExample:
    """One calibration prompt, prepared once: the teacher's answer and log-probabilities, the source's features."""

    ids: torch.Tensor                       # [T] the prompt; rows 0..T-2 come from the map
    answer: torch.Tensor                    # [m] the teacher's greedy answer tokens
    teacher_logp: torch.Tensor              # [m, V] float32: log p_full(. | prompt, answer_<j)
    feats: list = field(repr=False)         # per source layer (K~, V) [T-1, H*D] float32
    hidden: dict | None = field(default=None, repr=False)   # source hidden states, for maps that read them


def _shifter(model):
    from ..model_check import require
    from ..rope import RopeShifter

    return RopeShifter(model, layout=require(model, rope=True, who="output fitting").rope_layout)


@torch.no_grad()
def make_examples(source, target, prompts, mapper: KVMapper, answer_tokens: int = 8,
                  progress: bool = True) -> list[FitExample]:
    """Teacher answers and log-probabilities (target full prefill, greedy) and source features of ``prompts``."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..kv import kv_of
    from .mapper import run_source

    src_shift = _shifter(source)
    out = []
    for ids in tqdm(prompts, desc="teacher", disable=not progress, unit="prompt"):
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.numel() < 2:
            raise ValueError("a calibration prompt needs at least 2 tokens")
        gen = target.generate(ids[None], max_new_tokens=answer_tokens, do_sample=False, min_new_tokens=answer_tokens,
                              return_dict_in_generate=True, output_logits=True)
        answer = gen.sequences[0, ids.numel():]
        logp = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), -1)
        n = ids.numel() - 1
        cache = DynamicCache(config=source.config)
        if mapper.hidden_layers:
            hidden = run_source(source, ids[None, :n], cache, mapper.hidden_layers)
            hidden = {s: h.reshape(-1, h.shape[-1])[:n] for s, h in hidden.items()}
        else:
            source(input_ids=ids[None, :n], use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
            hidden = None
        feats = content_features(kv_of(cache), src_shift, torch.arange(n))
        out.append(FitExample(ids, answer, logp, feats, hidden))
    return out


def save_examples(examples: list[FitExample], folder) -> None:
    """Write prepared examples to ``folder/examples.safetensors`` + ``.json`` (sha256 recorded): the teacher pass
    is the expensive part, keep it."""
    from ..artifacts import write_artifact

    t = {}
    for i, ex in enumerate(examples):
        t[f"{i}.ids"], t[f"{i}.answer"], t[f"{i}.teacher_logp"] = ex.ids, ex.answer, ex.teacher_logp
        for s, (k, v) in enumerate(ex.feats):
            t[f"{i}.k.{s}"], t[f"{i}.v.{s}"] = k, v
        for s, h in (ex.hidden or {}).items():
            t[f"{i}.h.{s}"] = h
    write_artifact(folder, "examples", t, {"format": "hf_kvreuse.output_fit.examples", "n": len(examples)})


def load_examples(folder) -> list[FitExample]:
    """Read what :func:`save_examples` wrote, verified (sha256, finite values: CorruptArtifactError otherwise)."""
    from ..artifacts import read_artifact

    t, meta = read_artifact(folder, "examples", "output-fit examples")
    if meta.get("format") != "hf_kvreuse.output_fit.examples":
        raise ValueError(f"{folder}: not a folder of output-fit examples")
    out = []
    for i in range(int(meta["n"])):
        n_src = sum(1 for k in t if k.startswith(f"{i}.k."))
        hidden = {int(k.rsplit(".", 1)[1]): v for k, v in t.items() if k.startswith(f"{i}.h.")}
        out.append(FitExample(t[f"{i}.ids"], t[f"{i}.answer"], t[f"{i}.teacher_logp"],
                              [(t[f"{i}.k.{s}"], t[f"{i}.v.{s}"]) for s in range(n_src)], hidden or None))
    return out


def _student_logp(mapper: KVMapper, target, ex: FitExample, shifter) -> torch.Tensor:
    """Log-probabilities of the target reading the mapped cache, at the answer positions (differentiable)."""
    from transformers import DynamicCache

    from ..compat import cache_kwargs

    n = ex.ids.numel() - 1
    cache = DynamicCache(config=target.config)
    kv = mapper.translate_features(ex.feats, torch.arange(n), shifter, next(target.parameters()).dtype,
                                   hidden=ex.hidden)
    for t, (k, v) in enumerate(kv):
        cache.update(k, v, t)
    inp = torch.cat([ex.ids[n:], ex.answer[:-1]])[None]
    pos = torch.arange(n, n + inp.shape[1])[None]
    logits = target(input_ids=inp, position_ids=pos, use_cache=True, **cache_kwargs(cache)).logits[0]
    return torch.log_softmax(logits.float(), -1)


def _kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    t = teacher_logp.float()
    return (t.exp() * (t - student_logp)).sum(-1).mean()


@torch.no_grad()
def output_kl(mapper: KVMapper, target, examples: list[FitExample]) -> dict:
    """Mean KL(full prefill || mapped cache) over the answer positions of ``examples``, and the share of those
    positions whose argmax equals the full prefill's (teacher-forced)."""
    shifter = _shifter(target)
    kls, agree, total = [], 0, 0
    for ex in examples:
        s = _student_logp(mapper, target, ex, shifter)
        kls.append(float(_kl(ex.teacher_logp, s)))
        agree += int((s.argmax(-1) == ex.teacher_logp.float().argmax(-1)).sum())
        total += s.shape[0]
    return {"kl": sum(kls) / len(kls), "top1_agreement": agree / max(1, total), "n": len(examples)}


def fit_outputs(mapper: KVMapper, target, examples: list[FitExample], config: OutputFitConfig | None = None,
                val_examples: list[FitExample] | None = None, progress: bool = True,
                budget_s: float | None = None, on_epoch=None) -> tuple[KVMapper, list[dict]]:
    """Fine-tune a copy of ``mapper`` through the frozen ``target`` (module docstring); return it and the history.

    ``budget_s`` stops after the epoch in which that many seconds passed. ``on_epoch(mapper, record)`` is called
    after every epoch (e.g. to checkpoint). With ``val_examples`` the epoch of lowest validation KL is returned
    (epoch 0: the closed form itself)."""
    from tqdm.auto import tqdm

    cfg = config or OutputFitConfig()
    if not examples:
        raise ValueError("fit_outputs needs at least one example (make_examples)")
    fitted = copy.deepcopy(mapper)
    params, anchors = [], []
    for lm in fitted.layers:
        for name in ("w_k", "b_k", "w_v", "b_v"):
            p = torch.nn.Parameter(getattr(lm, name).detach().clone().float())
            setattr(lm, name, p)
            params.append(p)
            if name.startswith("w"):
                anchors.append((p, p.detach().clone(), float(p.detach().pow(2).sum()) or 1.0))
    opt = torch.optim.Adam(params, lr=cfg.lr)
    shifter = _shifter(target)
    was = [p.requires_grad for p in target.parameters()]
    for p in target.parameters():
        p.requires_grad_(False)
    history = []

    def snapshot():
        return [(lm.w_k.detach().clone(), lm.b_k.detach().clone(), lm.w_v.detach().clone(), lm.b_v.detach().clone())
                for lm in fitted.layers]

    best = (output_kl(fitted, target, val_examples)["kl"], 0, snapshot()) if val_examples else None
    if best is not None:
        history.append({"epoch": 0, "train_kl": None, "val_kl": best[0]})
    rng = random.Random(cfg.seed)
    t0 = time.perf_counter()
    try:
        for epoch in range(1, cfg.epochs + 1):
            order = list(range(len(examples)))
            rng.shuffle(order)
            losses = []
            for i in tqdm(order, desc=f"output fit {epoch}/{cfg.epochs}", disable=not progress, unit="prompt"):
                ex = examples[i]
                loss = _kl(ex.teacher_logp, _student_logp(fitted, target, ex, shifter))
                losses.append(float(loss.detach()))
                if cfg.anchor:
                    loss = loss + cfg.anchor * sum((p - p0).pow(2).sum() / s for p, p0, s in anchors)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            rec = {"epoch": epoch, "train_kl": sum(losses) / len(losses), "seconds": time.perf_counter() - t0}
            if val_examples:
                rec["val_kl"] = output_kl(fitted, target, val_examples)["kl"]
                if rec["val_kl"] < best[0]:
                    best = (rec["val_kl"], epoch, snapshot())
            history.append(rec)
            if on_epoch is not None:
                on_epoch(fitted, rec)
            if not math.isfinite(rec["train_kl"]):
                raise FloatingPointError(f"output fit diverged at epoch {epoch} (train KL {rec['train_kl']})")
            if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                break
    finally:
        for p, w in zip(target.parameters(), was):
            p.requires_grad_(w)
    if best is not None:
        for lm, (wk, bk, wv, bv) in zip(fitted.layers, best[2]):
            lm.w_k, lm.b_k, lm.w_v, lm.b_v = wk, bk, wv, bv
    for lm in fitted.layers:
        for name in ("w_k", "b_k", "w_v", "b_v"):
            setattr(lm, name, getattr(lm, name).detach().clone())
    fitted.info = dict(fitted.info, output_fit=dict(asdict(cfg), examples=len(examples),
                                                     val_examples=len(val_examples or []),
                                                     best_epoch=best[1] if best is not None else len(history),
                                                     history=history))
    return fitted, history
