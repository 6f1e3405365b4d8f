"""Every error class the library defines derives from one base, ``hf_kvreuse.HFKVReuseError``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import hf_kvreuse
from hf_kvreuse import HFKVReuseError

OPTIONAL = ("hf_kvreuse.vllm.connector", "hf_kvreuse.triton")  # need vllm / triton installed


def _modules():
    for info in pkgutil.walk_packages(hf_kvreuse.__path__, "hf_kvreuse."):
        if info.name.startswith(OPTIONAL) or ".__main__" in info.name:
            continue
        yield importlib.import_module(info.name)


def test_every_library_error_derives_from_the_base():
    """Planted bug: ``UnsupportedRopeError`` derives from ``ValueError`` only -> it is listed as missing."""
    found, missing = [], []
    for mod in _modules():
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__
                    and not name.startswith("_")):  # private ones are control flow inside one module
                found.append(f"{mod.__name__}.{name}")
                if not issubclass(obj, HFKVReuseError):
                    missing.append(f"{mod.__name__}.{name}")
    assert len(found) >= 12, found
    assert not missing, f"errors not derived from HFKVReuseError: {missing}"


def test_errors_keep_their_builtin_kind():
    assert issubclass(hf_kvreuse.UnsupportedModelError, ValueError)
    from hf_kvreuse.stores.base import StoreUnavailableError

    assert issubclass(StoreUnavailableError, ConnectionError)
