"""Saved artifacts (maps, bridges, adapters): written with a sha256 of each tensor file, verified on load.

Everything the library saves is safetensors plus JSON (never pickles). A file can still be changed after it was
written (a partial copy, a flipped bit, an edit): loading it as it is would make a cache emit garbage (NaN
logits decode as token 0) with no error. So :func:`write_artifact` records the sha256 of the tensor file in the
JSON, :func:`read_artifact` refuses a file whose sha256 differs, and every loaded floating tensor must be finite.
Folders written by other tools (peft's adapter folders) get a sidecar ``sha256.json`` (:func:`record_files`,
:func:`verify_files`).

The file rules are :mod:`hf_kvreuse.safe_files`' (docs/storage-safety.md): the tensor bytes are hashed before the
rename that publishes them, temporaries have unique names, the JSON carries the sha256 of its own fields
(``meta_sha256``, checked on load), and a file name a JSON records must stay inside its folder.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from . import safe_files
from .models.offline import sha256_of
from .errors import HFKVReuseError

SIDECAR = "sha256.json"


class CorruptArtifactError(HFKVReuseError, ValueError):
    """A saved artifact's file does not match its recorded sha256, or holds non-finite values."""


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise :class:`CorruptArtifactError` naming the first floating tensor with a NaN or an infinity."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CorruptArtifactError(f"{what}: tensor {name!r} holds {bad} non-finite values (NaN or inf); the "
                                       "file is corrupted or was saved from a diverged fit. Re-create it")


def _write_json(path: Path, meta: dict) -> None:
    # atomic, unique temporary: a reader sees the old JSON or the new one, never half of it
    safe_files.write_atomic(path.parent, path.name, json.dumps(meta, indent=2, default=str).encode())


def write_artifact(folder: str | os.PathLike, name: str, tensors: dict[str, torch.Tensor], meta: dict,
                   content_named: bool = False) -> Path:
    """``folder/name.safetensors`` and ``folder/name.json`` (``meta`` plus ``"file"``, ``"sha256"`` of the tensor
    file, hashed before its rename, and ``"meta_sha256"``, the JSON's own digest).

    ``content_named``: the tensor file is ``name.<sha>.safetensors`` (for folders several writers share: each JSON
    then names the tensors its own writer wrote; older tensor files are the caller's to prune)."""
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    check_finite(tensors, f"{name} (not saved)")
    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    sha = safe_files.sha256_bytes(data)
    file = f"{name}.{sha[:32]}.safetensors" if content_named else f"{name}.safetensors"
    safe_files.write_atomic(folder, file, data, sha)
    _write_json(folder / f"{name}.json", safe_files.sign(dict(meta, file=file, sha256={file: sha})))
    return folder


def read_meta(folder: str | os.PathLike, name: str, what: str) -> dict:
    """The JSON of an artifact, its own digest checked (a JSON without one, from an older hf_kvreuse, is read with
    a warning)."""
    path = safe_files.inside(folder, f"{name}.json", what, CorruptArtifactError)
    if not path.exists():
        raise FileNotFoundError(f"no {what} at {folder} (expected {name}.json and {name}.safetensors)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptArtifactError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptArtifactError(f"{what}: {path} is not a JSON object")
    if safe_files.SIGNATURE in meta:
        safe_files.check_signed(meta, f"{what}: {path}", error=CorruptArtifactError)
    else:
        warnings.warn(f"{what}: {path} carries no digest of its own (saved by an older hf_kvreuse): its fields are not "
                      "verified. Save it again to record one", stacklevel=3)
    return meta


def verify_file(file: Path, recorded: str | None, what: str) -> None:
    """Refuse ``file`` when its sha256 is not ``recorded``; warn when nothing was recorded (an older save)."""
    if recorded is None:
        warnings.warn(f"{what}: {file} has no recorded sha256 (saved by an older hf_kvreuse): its integrity is not "
                      "verified, only that its values are finite. Save it again to record one", stacklevel=3)
        return
    got = sha256_of(file)
    if got != recorded:
        raise CorruptArtifactError(f"{what}: {file} has sha256 {got[:16]}..., the recorded one is "
                                   f"{recorded[:16]}...: the file was changed or corrupted after it was saved")


def read_artifact(folder: str | os.PathLike, name: str, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and JSON of :func:`write_artifact`, verified (sha256, finite values)."""
    from safetensors.torch import load

    folder = Path(folder)
    meta = read_meta(folder, name, what)
    name_ = meta.get("file", f"{name}.safetensors")
    file = safe_files.inside(folder, name_, what, CorruptArtifactError)
    recorded = (meta.get("sha256") or {}).get(name_) if isinstance(meta.get("sha256"), dict) else None
    if recorded is None:
        verify_file(file, None, what)  # an older save: warns
        data = file.read_bytes()
    else:
        try:
            data = safe_files.read_verified(folder, name_, recorded, what, CorruptArtifactError)
        except CorruptArtifactError as e:
            raise CorruptArtifactError(f"{what}: {e} (the file was changed or corrupted after it was saved)") from None
    try:
        tensors = load(data)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CorruptArtifactError(f"{what}: {file} is not a readable safetensors file ({e})") from None
    check_finite(tensors, f"{what} ({file})")
    return tensors, meta


def record_files(folder: str | os.PathLike, pattern: str = "*.safetensors") -> None:
    """Write ``folder/sha256.json`` with the sha256 of each file matching ``pattern`` (for folders another tool
    wrote, e.g. peft's ``save_pretrained``)."""
    folder = Path(folder)
    _write_json(folder / SIDECAR, {f.name: sha256_of(f) for f in sorted(folder.glob(pattern))})


def verify_files(folder: str | os.PathLike, what: str, pattern: str = "*.safetensors") -> None:
    """Check every file matching ``pattern`` in ``folder`` against ``sha256.json`` and for finite values."""
    from safetensors.torch import load_file

    folder = Path(folder)
    side = folder / SIDECAR
    recorded = json.loads(side.read_text()) if side.exists() else {}
    for file in sorted(folder.glob(pattern)):
        verify_file(file, recorded.get(file.name), what)
        check_finite(load_file(str(file)), f"{what} ({file})")
