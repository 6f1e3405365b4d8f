"""One distillation example of the LatentRemedy bridge (a leaf module shared by the data builder and the trainer).

The bridge is trained, as in LatentRemedy / RestoreKV-style remedies of reused caches, to make the student's
continuation after a directly reused block match the teacher's full-prefill answer; :class:`Example` holds what one
(record, direction) contributes. :mod:`hf_kvreuse.latent.data` builds and stores examples,
:mod:`hf_kvreuse.latent.train` trains on them; the shard files both read are written and read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kv import KV

#: hidden states kept per example for the bridge's read-out: -1 = after the final norm, i = after decoder layer i
READ_LAYERS = (-1, 7, 11, 15, 19)


@dataclass
class Example:
    """Constants of one (record, direction): the student's cached prefix + reused block and the teacher's targets.

    ``feats`` holds the prefix's hidden states at :data:`READ_LAYERS` (``[R, s, d]``; ``h`` is the final-norm
    state of its last row); ``ids`` the target prompt followed by the teacher answer but its last token.
    """

    kv: KV                    # prefix + reused block K/V, rows 0..e-1
    h: torch.Tensor           # [1, d] the prefix's last hidden state (the bridge's default read-out)
    e: int                    # where the latents go (block end)
    tail_ids: torch.Tensor    # [1, m] question (+ assistant header) + teacher answer tokens but the last
    first: int                # index in tail_ids of the last prompt token (its logits give the first answer token)
    top_idx: torch.Tensor     # [P, k] teacher top-k token ids at the supervised positions
    top_logp: torch.Tensor    # [P, k] teacher log-probs there (renormalised over the top-k)
    s: int = 0                # block start (the prefix is rows 0..s-1)
    feats: torch.Tensor | None = None     # [R, s, d] prefix hidden states at read_layers
    read_layers: tuple = READ_LAYERS
    ids: torch.Tensor | None = None       # [1, e + m] prompt ids up to e, then tail_ids
    meta: dict = field(default_factory=dict)
    donor_feats: torch.Tensor | None = None  # [R, s', d] the donor prefix's hidden states (the other direction's feats)


# -- shards on disk: safetensors + JSON ------------------------------------------------------------------------
def save_shard(path: Path, exs: list[Example]) -> None:
    from safetensors.torch import save_file

    tensors, meta = {}, []
    for i, ex in enumerate(exs):
        tensors[f"{i}.k"] = torch.stack([k[0] for k, _ in ex.kv]).to(torch.float16).contiguous()
        tensors[f"{i}.v"] = torch.stack([v[0] for _, v in ex.kv]).to(torch.float16).contiguous()
        tensors[f"{i}.feats"] = ex.feats.to(torch.float16).contiguous()
        tensors[f"{i}.ids"] = ex.ids[0].contiguous()
        tensors[f"{i}.top_idx"] = ex.top_idx.contiguous()
        tensors[f"{i}.top_logp"] = ex.top_logp.to(torch.float16).contiguous()
        meta.append({"e": ex.e, "s": ex.s, "first": ex.first, "read_layers": list(ex.read_layers), **ex.meta})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path.with_suffix(".safetensors")))
    path.with_suffix(".json").write_text(json.dumps(meta, indent=0))


def load_shard(path: Path, dtype=torch.float32) -> list[Example]:
    """Examples of a shard (K/V and features stay float16 until a batch uses them)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    t = load_file(str(path.with_suffix(".safetensors")))
    exs = []
    for i, m in enumerate(meta):
        k, v = t[f"{i}.k"], t[f"{i}.v"]
        if k.shape[-2] != m["e"] or not torch.isfinite(k).all() or not torch.isfinite(v).all():
            raise ValueError(f"{path}: example {i} has K/V of {k.shape[-2]} rows (expected {m['e']}) or non-finite")
        ids = t[f"{i}.ids"][None]
        rl = tuple(m["read_layers"])
        feats = t[f"{i}.feats"]
        exs.append(Example(kv=[(k[j][None], v[j][None]) for j in range(k.shape[0])],
                           h=feats[rl.index(-1), -1:].float(), e=m["e"], tail_ids=ids[:, m["e"]:], first=m["first"],
                           top_idx=t[f"{i}.top_idx"], top_logp=t[f"{i}.top_logp"].float(), s=m["s"], feats=feats,
                           read_layers=rl, ids=ids, meta={k2: v2 for k2, v2 in m.items()
                                                          if k2 not in ("e", "s", "first", "read_layers")}))
    pair_donors(exs)
    return exs


def pair_donors(exs: list[Example]) -> None:
    """Set each example's ``donor_feats``: the donor of ``X -> Y`` is X, whose own prefix is the target prefix of
    ``Y -> X`` of the same record (a record's two directions are made together, so they share a shard)."""
    by_key = {(ex.meta.get("record"), ex.meta.get("direction")): ex for ex in exs}
    for ex in exs:
        src, _, tgt = str(ex.meta.get("direction", "")).partition("->")
        other = by_key.get((ex.meta.get("record"), f"{tgt}->{src}"))
        ex.donor_feats = other.feats if other is not None else None


def load_examples(folder: str | Path, families=None, max_per_family: int | None = None) -> list[Example]:
    """Every shard under ``folder`` (``<family>_<start>.safetensors``), optionally only some families."""
    out: dict[str, list[Example]] = {}
    for p in sorted(Path(folder).glob("*.json")):
        if p.name.startswith("screen") or not p.with_suffix(".safetensors").exists():
            continue
        fam = p.stem.rsplit("_", 1)[0]
        if families and fam not in families:
            continue
        out.setdefault(fam, []).extend(load_shard(p))
    exs = []
    for fam in sorted(out):
        exs.extend(out[fam][:max_per_family] if max_per_family else out[fam])
    return exs
