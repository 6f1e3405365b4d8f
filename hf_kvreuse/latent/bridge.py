"""LatentBridge: the MLP of LatentRemedy (seed 003, arXiv 2610.18014; METHODS.md §2.2).

"An MLP maps the last hidden state of the target prefix into a small number of latent tokens, which are placed
after the reused KV block to interact with the shared context", trained by full-prefill distillation with the
LLM frozen. The abstract gives no sizes; the choices here (measured in README):

* ``h``: the hidden state of the prefix's last token after the final norm (``hidden_layer=-1``, what the LM
  head reads), or after decoder layer ``hidden_layer``;
* ``Z = base + MLP(h)``, ``MLP = Linear(d, hidden) -> GELU -> Linear(hidden, n * d)``; ``base`` (``[n, d]``) starts
  at the mean input embedding of the vocabulary and the last layer at zero, so an untrained bridge emits ``n``
  copies of an "average token": a harmless start that distillation moves;
* the latents enter as input embeddings (the model's own embedding scale is not applied again).

``n_latent=0`` emits nothing: the cache is then exactly direct reuse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

FORMAT = "hf_kvreuse.LatentBridge"
VERSION = 1


class LatentBridgeMismatchError(ValueError):
    """A LatentBridge checkpoint made for another model."""


class LatentBridge(nn.Module):
    """Maps the target prefix's last hidden state to ``n_latent`` input embeddings.

    Parameters
    ----------
    model : PreTrainedModel
        The frozen LLM (sizes and the identity checked on load).
    n_latent : int, default=8
    hidden : int, default=256
        Width of the MLP's hidden layer (the checkpoint is ``~(d + n*d) * hidden`` parameters).
    hidden_layer : int, default=-1
        Where ``h`` is read: -1 = after the final norm; ``i >= 0`` = the residual stream after decoder layer ``i``.
    """

    def __init__(self, model, n_latent: int = 8, hidden: int = 256, hidden_layer: int = -1):
        super().__init__()
        from ..translation.mapper import model_identity

        if n_latent < 0 or hidden < 1:
            raise ValueError(f"n_latent must be >= 0 and hidden >= 1 (got {n_latent}, {hidden})")
        n_layers = model.config.num_hidden_layers
        if not -1 <= hidden_layer < n_layers:
            raise ValueError(f"hidden_layer must be -1 or in [0, {n_layers})")
        d = model.config.hidden_size
        self.n_latent, self.hidden, self.hidden_layer, self.d = n_latent, hidden, hidden_layer, d
        self.identity = model_identity(model)
        emb = model.get_input_embeddings().weight.detach().float()
        self.base = nn.Parameter(emb.mean(0).repeat(n_latent, 1).clone())
        self.scale = float(emb.norm(dim=-1).mean())  # typical embedding norm: inputs are normalised by it
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, n_latent * d)) if n_latent \
            else None
        if self.mlp is not None:
            nn.init.zeros_(self.mlp[2].weight)
            nn.init.zeros_(self.mlp[2].bias)
        self.info: dict = {}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ``[B, d]`` -> latent embeddings ``[B, n_latent, d]`` (float32)."""
        if self.mlp is None:
            return self.base[None].expand(h.shape[0], 0, self.d)
        h = h.float()
        h = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6) * (self.d ** 0.5)  # scale-free input
        out = self.mlp(h).reshape(h.shape[0], self.n_latent, self.d) * self.scale / (self.d ** 0.5)
        return self.base[None] + out

    # -- persistence: safetensors + JSON ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
        """``path/bridge.safetensors`` + ``path/bridge.json`` (the model's identity and the tensor file's sha256
        inside)."""
        from ..artifacts import write_artifact

        meta = {"format": FORMAT, "version": VERSION, "n_latent": self.n_latent, "hidden": self.hidden,
                "hidden_layer": self.hidden_layer, "d": self.d, "identity": self.identity, "info": self.info}
        return write_artifact(path, "bridge", {k: v.detach().to(dtype) for k, v in self.state_dict().items()}, meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model) -> "LatentBridge":
        """Load a checkpoint for ``model``; refuse (:class:`LatentBridgeMismatchError`) one made for another, and
        (:class:`hf_kvreuse.artifacts.CorruptArtifactError`) a file that changed since it was saved."""
        from ..artifacts import read_artifact, read_meta
        from ..translation.mapper import _describe, model_identity

        path = Path(path)
        meta = read_meta(path, "bridge", "LatentBridge")
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path}: not a LatentBridge checkpoint of version {VERSION}")
        got = model_identity(model)
        if meta["identity"] != got:
            what = "architecture/config" if meta["identity"].get("config") != got.get("config") else "weights"
            raise LatentBridgeMismatchError(
                f"this LatentBridge was trained for {_describe(meta['identity'])}; the model given is "
                f"{_describe(got)} (its {what} differ). Train one for this model with python -m "
                "hf_kvreuse.latent.train")
        bridge = cls(model, meta["n_latent"], meta["hidden"], meta["hidden_layer"])
        state, meta = read_artifact(path, "bridge", "LatentBridge")
        bridge.load_state_dict({k: v.float() for k, v in state.items()})
        bridge.info = meta.get("info", {})
        return bridge

    @classmethod
    def from_pretrained(cls, model, path: str | os.PathLike | None = None) -> "LatentBridge":
        """The shipped checkpoint for ``model`` (or the one at ``path``)."""
        if path is None:
            from ..translation.mapper import model_identity

            ident = model_identity(model)
            here = Path(__file__).resolve().parent / "checkpoints"
            for folder in sorted(here.glob("*")) if here.exists() else []:
                meta_file = folder / "bridge.json"
                if meta_file.exists() and json.loads(meta_file.read_text()).get("identity") == ident:
                    return cls.load(folder, model)
            shipped = sorted(p.name for p in here.glob("*")) if here.exists() else []
            raise FileNotFoundError(f"no shipped LatentBridge checkpoint for {ident.get('class')} "
                                    f"({ident.get('model_type')}, weights {ident.get('weights')}); shipped: "
                                    f"{shipped or 'none'}. Train one: python -m hf_kvreuse.latent.train")
        return cls.load(path, model)

    def extra_repr(self) -> str:
        return f"n_latent={self.n_latent}, hidden={self.hidden}, hidden_layer={self.hidden_layer}, d={self.d}"
