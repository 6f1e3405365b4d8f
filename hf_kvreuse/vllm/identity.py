"""Which model made a stored K/V: identified by content on both sides, checked before any row is reused.

vLLM loads a model from a folder and never exposes a transformers model, so the store cannot key entries by
:func:`hf_kvreuse.fingerprint.model_fingerprint` alone. Both sides therefore name the model by what they can
both verify:

* the **weights**: the sha256 of every ``*.safetensors`` file of the folder (names and digests, sorted) and of its
  ``config.json``;
* the **config the model runs with**: :func:`hf_kvreuse.fingerprint.config_digest` (every config field that
  changes K/V: RoPE type, theta and scaling, attention multipliers, head sizes, windows, ...), of the config the
  engine or the transformers model actually uses, so one folder loaded with another ``rope_theta`` (or any other
  override) is another model;
* the **compute dtype** of the K/V (float32 K/V of a float32 model are not those of the same weights in bf16).

On the vLLM side the folder is the one vLLM loads (``model_config.model``), hashed when the connector starts. On
the transformers side :func:`hf_model_identity` compares every parameter of the model, element for element, with
the tensors of the folder it names (after the cast its dtype implies) before it vouches for the folder's digest:
a model changed in memory (fine-tuned, an adapter merged) is refused, never stored under the folder's name. The
model fingerprint is recorded beside it (what the library's own caches and sessions key by).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.offline import sha256_of
from ..errors import HFKVReuseError


class ModelMismatchError(HFKVReuseError, ValueError):
    """The model is not the one a store or an entry was written for, or its weights differ from its folder."""


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies the K/V a model computes.

    Attributes
    ----------
    weights_sha256 : str
        sha256 over the sorted ``name:sha256`` lines of the folder's safetensors files and config.json.
    dtype : str
        The dtype the K/V were computed and are stored in (``"float32"``, ``"bfloat16"``, ...).
    path : str
        The folder (informational: a copy of the same files elsewhere is the same model).
    hf_fingerprint : str or None
        :func:`~hf_kvreuse.fingerprint.model_fingerprint` of a transformers model of these weights, when one wrote.
    config_sha256 : str
        :func:`~hf_kvreuse.fingerprint.config_digest` of the config the model runs with.
    """

    weights_sha256: str
    dtype: str
    path: str = ""
    hf_fingerprint: str | None = None
    config_sha256: str = ""

    @property
    def key(self) -> str:
        """What two identities must share for their K/V to be interchangeable."""
        return f"{self.weights_sha256}:{self.config_sha256}:{self.dtype}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelIdentity":
        return cls(weights_sha256=str(d["weights_sha256"]), dtype=str(d["dtype"]),
                   config_sha256=str(d.get("config_sha256", "")), path=str(d.get("path", "")),
                   hf_fingerprint=d.get("hf_fingerprint"))


#: (folder, ((file, size, mtime_ns), ...)) -> digest: hashing a 6 GB folder once per process is enough
_FOLDER_DIGESTS: dict[tuple, str] = {}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(dtype).removeprefix("torch.")


def folder_digest(folder: str | os.PathLike) -> str:
    """sha256 over the sha256 of ``config.json`` and of every ``*.safetensors`` file of ``folder``.

    Raises ``FileNotFoundError`` when the folder holds no safetensors file (a hub name, a GGUF file, pickled
    weights: not identifiable by this store).
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights to identify the model by (the K/V store "
                                "identifies models by the content of a local safetensors folder)")
    files.append(folder / "config.json")
    stat_key = (str(folder.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if stat_key not in _FOLDER_DIGESTS:
        lines = [f"{f.name}:{sha256_of(f)}" for f in files]
        _FOLDER_DIGESTS[stat_key] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return _FOLDER_DIGESTS[stat_key]


def folder_identity(folder: str | os.PathLike, dtype, config=None) -> ModelIdentity:
    """The identity of the model vLLM (or anyone) loads from ``folder`` and runs in ``dtype`` with ``config`` (the
    config the engine really uses, overrides included: vLLM's ``model_config.hf_config``; default: the folder's
    own ``config.json`` as transformers reads it)."""
    from ..fingerprint import config_digest

    weights = folder_digest(folder)  # first: a folder without safetensors weights is refused as such
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder))
    return ModelIdentity(weights_sha256=weights, dtype=_dtype_name(dtype),
                         config_sha256=config_digest(config), path=str(folder))


def _model_folder(model) -> Path:
    name = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not name or not Path(name).is_dir():
        raise ModelMismatchError(f"{type(model).__name__}: its folder is unknown (config._name_or_path={name!r}); "
                                 "pass folder= (the safetensors folder it was loaded from)")
    return Path(name)


def check_weights_match(model, folder: str | os.PathLike) -> None:
    """Raise :class:`ModelMismatchError` unless every parameter of ``model`` equals the folder's tensor of that name
    (cast to the parameter's dtype) or shares storage with one that does (tied embeddings)."""
    from safetensors import safe_open

    folder = Path(folder)
    params = dict(model.named_parameters())
    matched: set[int] = set()
    seen = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                p = params.get(name)
                if p is None:
                    continue
                t = f.get_tensor(name).to(p.dtype)
                if tuple(t.shape) != tuple(p.shape) or not torch.equal(t, p.detach().cpu()):
                    raise ModelMismatchError(
                        f"{type(model).__name__}: parameter {name!r} differs from {file} (the model was changed "
                        "after loading, or was loaded from another folder): its K/V are not those of the folder's "
                        "weights")
                matched.add(p.untyped_storage().data_ptr())
                seen.add(name)
    missing = [n for n, p in params.items() if n not in seen and p.untyped_storage().data_ptr() not in matched]
    if missing:
        raise ModelMismatchError(f"{type(model).__name__}: {len(missing)} parameters are not in {folder} (e.g. "
                                 f"{missing[0]!r}: an adapter or a head added after loading); refused")


#: (id(model), model_fingerprint, folder digest) -> checked: one element-wise comparison per weights version
_CHECKED: set[tuple] = set()


def hf_model_identity(model, folder: str | os.PathLike | None = None) -> ModelIdentity:
    """The identity of a transformers ``model``'s K/V, after checking its weights equal ``folder``'s.

    ``folder`` defaults to the model's ``config._name_or_path``. The config part is the model's own config (a
    model loaded with another ``rope_theta`` than the folder's is another identity).
    The element-wise comparison runs once per model
    and weights version (the model fingerprint changes with any write to a parameter).
    """
    from ..fingerprint import config_digest, model_fingerprint

    folder = Path(folder) if folder is not None else _model_folder(model)
    fp = model_fingerprint(model)
    digest = folder_digest(folder)
    key = (id(model), fp, digest)
    if key not in _CHECKED:
        check_weights_match(model, folder)
        _CHECKED.add(key)
    dtype = next(model.parameters()).dtype
    return ModelIdentity(weights_sha256=digest, dtype=_dtype_name(dtype), config_sha256=config_digest(model.config),
                         path=str(folder), hf_fingerprint=fp)
