"""Saved artifacts (maps, bridges, adapters): written with a sha256 of each tensor file, verified on load.

Everything the library saves is safetensors plus JSON (never pickles). A file can still be changed after it was
written (a partial copy, a flipped bit, an edit): loading it as it is would make a cache emit garbage (NaN
logits decode as token 0) with no error. So :func:`write_artifact` records the sha256 of the tensor file in the
JSON, :func:`read_artifact` refuses a file whose sha256 differs, and every loaded floating tensor must be finite.
Folders written by other tools (peft's adapter folders) get a sidecar ``sha256.json`` (:func:`record_files`,
:func:`verify_files`).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from .models.offline import sha256_of

SIDECAR = "sha256.json"


class CorruptArtifactError(ValueError):
    """A saved artifact's file does not match its recorded sha256, or holds non-finite values."""


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise :class:`CorruptArtifactError` naming the first floating tensor with a NaN or an infinity."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CorruptArtifactError(f"{what}: tensor {name!r} holds {bad} non-finite values (NaN or inf); the "
                                       "file is corrupted or was saved from a diverged fit. Re-create it")


def _write_json(path: Path, meta: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str))
    os.replace(tmp, path)  # atomic: a reader sees the old JSON or the new one, never half of it


def write_artifact(folder: str | os.PathLike, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """``folder/name.safetensors`` and ``folder/name.json`` (``meta`` plus ``"sha256"`` of the tensor file)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    check_finite(tensors, f"{name} (not saved)")
    file = folder / f"{name}.safetensors"
    tmp = file.with_name(file.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, file)
    _write_json(folder / f"{name}.json", dict(meta, sha256={file.name: sha256_of(file)}))
    return folder


def read_meta(folder: str | os.PathLike, name: str, what: str) -> dict:
    path = Path(folder) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no {what} at {folder} (expected {name}.json and {name}.safetensors)")
    return json.loads(path.read_text())


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
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = read_meta(folder, name, what)
    file = folder / f"{name}.safetensors"
    verify_file(file, (meta.get("sha256") or {}).get(file.name), what)
    tensors = load_file(str(file))
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
