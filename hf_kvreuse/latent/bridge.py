"""LatentBridge: the MLP of LatentRemedy (seed 003, arXiv 2610.18014; METHODS.md §2.2).

"An MLP maps the last hidden state of the target prefix into a small number of latent tokens, which are placed
after the reused KV block to interact with the shared context", trained by full-prefill distillation with the
LLM frozen. The abstract gives no sizes; the choices here (measured in the research notes):

* ``h``: the hidden state of the prefix's last token after the final norm (``hidden_layer=-1``, what the LM
  head reads), or after decoder layer ``hidden_layer``;
* ``Z = base + MLP(h)``, ``MLP = Linear(d, hidden) -> GELU -> Linear(hidden, n * d)``; ``base`` (``[n, d]``) starts
  at the mean input embedding of the vocabulary and the last layer at zero, so an untrained bridge emits ``n``
  copies of an "average token": a harmless start that distillation moves;
* the latents enter as input embeddings (the model's own embedding scale is not applied again).

``n_latent=0`` emits nothing: the cache is then exactly direct reuse.

``lora_rank=r > 0`` adds the alternative bridge of RestoreKV (kvpress, arXiv 2608.01247: learned restore tokens
plus a LoRA, self-distilled): a rank-``r`` update ``x A^T B^T`` of the model's projections (``lora_modules``, by
default the attention's ``q/k/v/o``) in every decoder layer, **active on the latent rows only**
(:meth:`LatentBridge.lora_active`). The other rows run the frozen model, so the prompt's own K/V and the
returned cache are the model's; only the latents' K/V, and through them what later rows read, change. ``B``
starts at zero: an untrained LoRA is a no-op (tested).

``readout="gated"`` (this project's variant, not in the paper) keeps the latents out of the model's own attention:
they still run after the block (positions ``e .. e+n-1``, attending to the prefix and the reused block), but the
other rows read them through a small cross-attention added to the residual stream after every decoder layer
(:class:`GatedReadout`, Flamingo-style gated cross-attention, arXiv 2204.14198), whose output projection starts at
zero. An untrained gated bridge therefore changes nothing: the cache is exactly the one without latents (direct
reuse, or the focus / tail rows it recomputes), and training can only add to it. The read-out acts on every row
computed while the cache serves ``generate`` (the recomputed rows, the question, the answer).

``rows="focus"`` records that the bridge was trained with FocusRecompute's rows recomputed beside the latents
(the cache then needs the tokenizer as ``focus=``); ``"tail"`` with the block's last ``tail_tokens`` rows.

``donor=True`` (an ablation, not in the paper) also reads the prefix the reused block was computed under
(the donor agent's instructions), with the same read-out, and feeds both to the MLP: the block's K/V carry the
donor's focus, and a bridge that sees only the target's own prefix cannot know which focus it has to undo.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..local_hooks import local_hooks
from ..errors import HFKVReuseError

FORMAT = "hf_kvreuse.LatentBridge"
VERSION = 5
READABLE = (1, 2, 3, 4, 5)  # version 1: one layer, last row, no tail; 2: no LoRA; 3: no donor read-out; 4: tokens
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


class LatentBridgeMismatchError(HFKVReuseError, ValueError):
    """A LatentBridge checkpoint made for another model."""


class LatentBridge(nn.Module):
    """Maps the target prefix's hidden states to ``n_latent`` input embeddings.

    Parameters
    ----------
    model : PreTrainedModel
        The frozen LLM (sizes and the identity checked on load).
    n_latent : int, default=8
    hidden : int, default=256
        Width of the MLP's hidden layer (the checkpoint is ``~(F + n*d) * hidden`` parameters, ``F`` the input).
    hidden_layer : int, default=-1
        Where ``h`` is read: -1 = after the final norm; ``i >= 0`` = the residual stream after decoder layer ``i``.
    layers : tuple of int, optional
        Read several layers (each as ``hidden_layer``); their read-outs are concatenated. Default ``(hidden_layer,)``.
    read : {"last", "attn"}, default="last"
        ``"last"``: the prefix's last token at each layer; ``"attn"``: that, plus an attention-pooled summary of all
        the prefix's tokens per layer (one learned query per layer; it starts at zero, i.e. mean pooling).
    tail_tokens : int, default=0
        The block rows recomputed with the latents (latents plus Tail-k) this bridge is meant for; the cache's
        default (:class:`~hf_kvreuse.cache_classes.latent_remedy.LatentRemedyCache` ``tail_tokens=None``).
    lora_rank : int, default=0
        Rank of a LoRA on ``lora_modules`` of every decoder layer, active on the latent rows only (RestoreKV's
        bridge); 0: none.
    lora_modules : tuple of str, default=("q_proj", "k_proj", "v_proj", "o_proj")
        Names (last component) of the ``nn.Linear`` modules of a decoder layer that the LoRA adapts; a name that
        the model's layers lack is refused.
    donor : bool, default=False
        Also read the donor's prefix (the tokens the reused block was computed after) the same way; the MLP sees
        both read-outs. The cache reads the donor prefix of the last reused block (``block_prefix_ids``) and refuses
        a last block computed standalone.
    readout : {"tokens", "gated"}, default="tokens"
        ``"tokens"``: the latents are rows of the cache that later rows attend to (the paper's); ``"gated"``: they
        are read through a zero-initialised :class:`GatedReadout` (an untrained bridge changes nothing).
    readout_rank : int, default=32
        Width of the gated read-out's query / key / value projections.
    rows : {"tail", "focus"}, default="tail"
        Which block rows the bridge was trained to run with (``tail_tokens`` of them): the block's last rows, or
        FocusRecompute's focus rows first (the cache then needs ``focus=tokenizer``).
    """

    def __init__(self, model, n_latent: int = 8, hidden: int = 256, hidden_layer: int = -1,
                 layers: tuple[int, ...] | None = None, read: str = "last", tail_tokens: int = 0,
                 lora_rank: int = 0, lora_modules: tuple[str, ...] = LORA_MODULES, donor: bool = False,
                 readout: str = "tokens", readout_rank: int = 32, rows: str = "tail"):
        super().__init__()
        from ..translation.mapper import model_identity

        if n_latent < 0 or hidden < 1 or tail_tokens < 0 or lora_rank < 0:
            raise ValueError(f"n_latent, tail_tokens and lora_rank must be >= 0 and hidden >= 1 (got {n_latent}, "
                             f"{tail_tokens}, {lora_rank}, {hidden})")
        n_layers = model.config.num_hidden_layers
        layers = tuple(int(x) for x in (layers if layers is not None else (hidden_layer,)))
        if not layers or any(not -1 <= x < n_layers for x in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"hidden_layer / layers must be distinct values of -1 or [0, {n_layers}), got {layers}")
        if read not in ("last", "attn"):
            raise ValueError(f"read must be 'last' or 'attn', got {read!r}")
        if readout not in ("tokens", "gated") or rows not in ("tail", "focus"):
            raise ValueError(f"readout must be 'tokens' or 'gated' and rows 'tail' or 'focus', got {readout!r} and "
                             f"{rows!r}")
        if readout == "gated" and (lora_rank or readout_rank < 1):
            raise ValueError("a gated read-out needs readout_rank >= 1 and no LoRA (the latents' rows are not the "
                             "other rows' keys, so a LoRA on them has nothing to adapt)")
        d = model.config.hidden_size
        self.n_latent, self.hidden, self.d = n_latent, hidden, d
        self.layers, self.read, self.tail_tokens, self.donor = layers, read, tail_tokens, bool(donor)
        self.hidden_layer = layers[0]
        self.identity = model_identity(model)
        emb = model.get_input_embeddings().weight.detach().float()
        self.base = nn.Parameter(emb.mean(0).repeat(n_latent, 1).clone())
        self.scale = float(emb.norm(dim=-1).mean())  # typical embedding norm: inputs are normalised by it
        f_in = len(layers) * d * (2 if read == "attn" else 1) * (2 if donor else 1)
        self.query = nn.Parameter(torch.zeros(len(layers), d)) if read == "attn" else None
        self.mlp = nn.Sequential(nn.Linear(f_in, hidden), nn.GELU(), nn.Linear(hidden, n_latent * d)) if n_latent \
            else None
        if self.mlp is not None:
            nn.init.zeros_(self.mlp[2].weight)
            nn.init.zeros_(self.mlp[2].bias)
        self.lora_rank = int(lora_rank) if n_latent else 0
        self.lora_modules = tuple(lora_modules)
        self.lora = _LoRAParams()
        if self.lora_rank:
            gen = torch.Generator().manual_seed(0)
            for key, lin in _lora_targets(model, self.lora_modules).items():
                a = torch.randn(self.lora_rank, lin.in_features, generator=gen) / lin.in_features ** 0.5
                self.lora[f"{key}-a"] = nn.Parameter(a)
                self.lora[f"{key}-b"] = nn.Parameter(torch.zeros(lin.out_features, self.lora_rank))
        self.readout, self.rows = readout, rows
        self.readout_rank = int(readout_rank) if readout == "gated" else 0
        self.gate = GatedReadout(n_layers, d, self.readout_rank) if readout == "gated" and n_latent else None
        self.info: dict = {}

    @property
    def gated(self) -> bool:
        """Whether the latents are read through the gated cross-attention (not as cache rows)."""
        return self.gate is not None

    @property
    def all_rows(self) -> bool:
        """Whether the read-out needs every prefix row (attention pooling) or only the last one."""
        return self.read == "attn"

    def _unit(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) * (self.d ** 0.5)  # scale-free

    def _read(self, f: torch.Tensor) -> list[torch.Tensor]:
        f = self._unit(f.float())
        parts = [f[:, -1]]
        if self.query is not None:
            w = torch.softmax((f @ self.query.float()[:, :, None])[..., 0] / self.d, dim=-1)  # [R, T]
            parts.append(self._unit((w[..., None] * f).sum(1)))
        return parts

    def encode(self, feats: list[torch.Tensor], donor: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Per example the prefix hidden states ``[len(layers), T, d]`` at :attr:`layers` (``T`` = all prefix rows,
        or only the last one for ``read="last"``), and for a ``donor`` bridge the donor prefix's the same way
        -> the MLP input ``[B, F]``."""
        if self.donor and (donor is None or len(donor) != len(feats)):
            raise ValueError("this bridge reads the donor's prefix too (donor=True): pass one donor read-out per "
                             "example")
        out = []
        for i, f in enumerate(feats):
            parts = self._read(f) + (self._read(donor[i]) if self.donor else [])
            out.append(torch.cat(parts, 0).reshape(-1))
        return torch.stack(out)

    def forward(self, h: torch.Tensor | list[torch.Tensor], donor=None) -> torch.Tensor:
        """``h`` ``[B, d]`` (the last prefix row at the one read layer) or a list of per-example read-outs as for
        :meth:`encode` (``donor`` likewise, for a ``donor=True`` bridge) -> latent embeddings ``[B, n_latent, d]``
        (float32)."""
        if isinstance(h, torch.Tensor) and h.dim() == 2:
            if len(self.layers) != 1 or self.read != "last":
                raise ValueError("this bridge reads several layers or all prefix rows: pass per-example read-outs")
            h = [x[None, None] for x in h]
            donor = [x[None, None] for x in donor] if isinstance(donor, torch.Tensor) else donor
        x = self.encode(list(h), None if donor is None else list(donor))
        if self.mlp is None:
            return self.base.float()[None].expand(x.shape[0], 0, self.d)
        # read-outs are float32; a bridge cast to bf16 (with its model) runs its MLP in that dtype, returns float32
        x = x.to(next(self.mlp.parameters()).dtype)
        out = self.mlp(x).float().reshape(x.shape[0], self.n_latent, self.d) * self.scale / (self.d ** 0.5)
        return self.base.float()[None] + out

    def latents(self, examples) -> torch.Tensor:
        """Latents of training examples (:class:`~hf_kvreuse.latent.data.Example`, with their stored read-outs)."""
        feats, donor = [], []
        for ex in examples:
            if self.donor:
                if ex.donor_feats is None:
                    raise ValueError("this bridge reads the donor's prefix (donor=True); the example has no donor "
                                     "hidden states (Example.donor_feats)")
                donor.append(self._pick(ex.donor_feats, ex.read_layers))
            if ex.feats is None:  # an example made for this bridge's one read-out (train.make_example)
                if len(self.layers) != 1 or self.all_rows:
                    raise ValueError(f"the example has no stored hidden states for layers {self.layers}")
                feats.append(ex.h.float()[None])
                continue
            feats.append(self._pick(ex.feats, ex.read_layers))
        return self(feats, donor if self.donor else None)

    def _pick(self, feats: torch.Tensor, read_layers) -> torch.Tensor:
        f = feats[[tuple(read_layers).index(x) for x in self.layers]]
        return f if self.all_rows else f[:, -1:]

    @contextlib.contextmanager
    def lora_active(self, model, rows: torch.Tensor):
        """Within the block, ``model``'s adapted projections add this bridge's LoRA update on the rows where
        ``rows`` (``[B, T]`` bool, the shape of the hidden states the decoder layers see) is set, the latent
        rows; in the calling thread only (a background prefill in another thread sees the frozen model). No LoRA:
        nothing changes."""
        if not self.lora_rank:
            yield
            return
        targets = _lora_targets(model, self.lora_modules)

        def make(a, b):
            def hook(mod, inp, out):
                x = inp[0]
                if x.shape[:-1] != rows.shape:
                    raise RuntimeError(f"LoRA rows mask {tuple(rows.shape)} does not match the hidden states "
                                       f"{tuple(x.shape[:-1])}")
                # a model split over devices: the factors and the mask go where this layer computes
                delta = (x.to(a.dtype) @ a.to(x.device).t() @ b.to(x.device).t()).to(out.dtype)
                return out + delta * rows[..., None].to(device=out.device, dtype=out.dtype)
            return hook
        with local_hooks() as hooks:  # this context only: a forward in another thread sees the frozen model
            for key, lin in targets.items():
                hooks.forward(lin, make(self.lora[f"{key}-a"], self.lora[f"{key}-b"]))
            yield

    @contextlib.contextmanager
    def capture_states(self, model):
        """Within the block, every decoder layer's output (the residual stream, ``[B, T, d]``) is appended to the
        yielded list, in the calling context only: run the latent rows there to get what :meth:`readout_active`
        reads."""
        from ..generation.partial import _decoder

        states: list[torch.Tensor] = []

        def grab(mod, inp, out):
            states.append(out[0] if isinstance(out, tuple) else out)
        with local_hooks() as hooks:
            for layer in _decoder(model).layers:
                hooks.forward(layer, grab)
            yield states

    def readout_hooks(self, hooks, model, states: list[torch.Tensor]) -> None:
        """Register, on ``hooks`` (a :class:`~hf_kvreuse.local_hooks.LocalHooks`), the gated read-out of the latent
        rows' per-layer states ``states`` (``[B, n, d]`` each) after every decoder layer of ``model``."""
        from ..generation.partial import _decoder

        layers = _decoder(model).layers
        if len(states) != len(layers):
            raise RuntimeError(f"{len(states)} latent states for {len(layers)} decoder layers")

        def make(i):
            def hook(mod, inp, out):
                h = out[0] if isinstance(out, tuple) else out
                h2 = self.gate(i, h, states[i].to(h.device))
                return (h2,) + tuple(out[1:]) if isinstance(out, tuple) else h2
            return hook
        for i, layer in enumerate(layers):
            hooks.forward(layer, make(i))

    @contextlib.contextmanager
    def readout_active(self, model, states: list[torch.Tensor]):
        """Within the block (the calling context only), every decoder layer's output rows read the latents through
        the gated read-out."""
        with local_hooks() as hooks:
            self.readout_hooks(hooks, model, states)
            yield

    # -- persistence: safetensors + JSON ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
        """``path/bridge.safetensors`` + ``path/bridge.json`` (the model's identity and the tensor file's sha256
        inside)."""
        from ..artifacts import write_artifact

        meta = {"format": FORMAT, "version": VERSION, "n_latent": self.n_latent, "hidden": self.hidden,
                "hidden_layer": self.hidden_layer, "layers": list(self.layers), "read": self.read,
                "tail_tokens": self.tail_tokens, "lora_rank": self.lora_rank, "lora_modules": list(self.lora_modules),
                "donor": self.donor, "readout": self.readout, "readout_rank": self.readout_rank or 32,
                "rows": self.rows,
                "d": self.d, "identity": self.identity, "info": self.info}
        return write_artifact(path, "bridge", {k: v.detach().to(dtype) for k, v in self.state_dict().items()}, meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model) -> "LatentBridge":
        """Load a checkpoint for ``model``; refuse (:class:`LatentBridgeMismatchError`) one made for another, and
        (:class:`hf_kvreuse.artifacts.CorruptArtifactError`) a file that changed since it was saved."""
        from ..artifacts import read_artifact, read_meta
        from ..translation.mapper import _describe, model_identity

        path = Path(path)
        meta = read_meta(path, "bridge", "LatentBridge")
        if meta.get("format") != FORMAT or meta.get("version") not in READABLE:
            raise ValueError(f"{path}: not a LatentBridge checkpoint of version {READABLE}")
        got = model_identity(model)
        if meta["identity"] != got:
            what = "architecture/config" if meta["identity"].get("config") != got.get("config") else "weights"
            raise LatentBridgeMismatchError(
                f"this LatentBridge was trained for {_describe(meta['identity'])}; the model given is "
                f"{_describe(got)} (its {what} differ). Train one for this model with python -m "
                "hf_kvreuse.latent.train")
        bridge = cls(model, meta["n_latent"], meta["hidden"], meta["hidden_layer"], meta.get("layers"),
                     meta.get("read", "last"), meta.get("tail_tokens", 0), meta.get("lora_rank", 0),
                     tuple(meta.get("lora_modules", LORA_MODULES)), bool(meta.get("donor", False)),
                     meta.get("readout", "tokens"), int(meta.get("readout_rank", 32)), meta.get("rows", "tail"))
        state, meta = read_artifact(path, "bridge", "LatentBridge")  # sha256 and finite values verified
        want = bridge.state_dict()
        if set(state) != set(want) or any(state[k].shape != want[k].shape for k in want):
            raise ValueError(f"{path}: the tensors in bridge.safetensors do not match bridge.json "
                             f"({sorted(state)} vs {sorted(want)})")
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
        return (f"n_latent={self.n_latent}, hidden={self.hidden}, layers={self.layers}, read={self.read}, "
                f"tail_tokens={self.tail_tokens}, lora_rank={self.lora_rank}, donor={self.donor}, readout={self.readout}, "
                f"rows={self.rows}, d={self.d}")


class GatedReadout(nn.Module):
    """Per decoder layer ``l``, rows ``h`` ``[B, T, d]`` read the latent rows' states ``z`` ``[B, n, d]`` (both at
    the layer's output) through a rank-``r`` attention, added to the residual stream:

    ``h' = h + |h|/sqrt(d) * O_l softmax(Q_l u K_l w^T / sqrt(r)) V_l w``, ``u = unit(h)``, ``w = unit(z)``

    (``unit`` scales a row to norm ``sqrt(d)``: the read-out is relative to the row's own scale). ``O_l`` starts at
    zero, so the untrained read-out adds exactly nothing and its first gradient reaches ``O_l`` (LoRA's ``B = 0``
    start); the query / key / value projections start random.
    """

    def __init__(self, n_layers: int, d: int, rank: int):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.d, self.rank = d, rank
        self.q = nn.Parameter(torch.randn(n_layers, rank, d, generator=gen) / d ** 0.5)
        self.k = nn.Parameter(torch.randn(n_layers, rank, d, generator=gen) / d ** 0.5)
        self.v = nn.Parameter(torch.randn(n_layers, rank, d, generator=gen) / d ** 0.5)
        self.o = nn.Parameter(torch.zeros(n_layers, d, rank))

    def forward(self, layer: int, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if z.shape[0] != h.shape[0]:
            raise RuntimeError(f"latent states of batch {z.shape[0]} for rows of batch {h.shape[0]}")
        hf, zf = h.float(), z.float()
        norm = hf.norm(dim=-1, keepdim=True)
        u = hf / norm.clamp_min(1e-6) * self.d ** 0.5
        w = zf / zf.norm(dim=-1, keepdim=True).clamp_min(1e-6) * self.d ** 0.5
        # float32 on the rows' device (a bridge cast to bf16 with its model, a model split over devices)
        wq, wk, wv, wo = (x[layer].to(device=h.device, dtype=torch.float32) for x in (self.q, self.k, self.v, self.o))
        q, k, v = u @ wq.t(), w @ wk.t(), w @ wv.t()
        a = torch.softmax(q @ k.transpose(-1, -2) / self.rank ** 0.5, dim=-1)
        out = (a @ v) @ wo.t()
        return h + (out * norm / self.d ** 0.5).to(h.dtype)

    def extra_repr(self) -> str:
        return f"layers={self.q.shape[0]}, d={self.d}, rank={self.rank}"


class _LoRAParams(nn.ParameterDict):
    """The LoRA's ``A`` / ``B`` per ``"<layer>-<module>"``; printed as one summary line, not 8 lines per layer."""

    def extra_repr(self) -> str:
        mods = sorted({k.split("-")[1] for k in self.keys()})
        return f"{len(self) // 2} adapted projections ({', '.join(mods)}), {sum(p.numel() for p in self.values())} " \
               "numbers" if len(self) else "none"


def _lora_targets(model, names: tuple[str, ...]) -> dict[str, nn.Linear]:
    """``{"<layer>-<name>": nn.Linear}`` of every decoder layer's modules named ``names`` (last component)."""
    from ..generation.partial import _decoder

    out = {}
    for i, layer in enumerate(_decoder(model).layers):
        found = {n.rsplit(".", 1)[-1]: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        missing = [n for n in names if n not in found]
        if missing:
            raise ValueError(f"LatentBridge LoRA: decoder layer {i} of {type(model).__name__} has no linear module "
                             f"named {missing} (it has {sorted(found)})")
        out.update({f"{i}-{n}": found[n] for n in names})
    return out
