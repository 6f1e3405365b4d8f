"""The library's one error base class: ``except hf_kvreuse.HFKVReuseError`` catches every error it raises on
purpose (refused models, adapters and RoPE kinds, artifacts and store entries that do not verify, a store that
cannot be reached). Each error also keeps its built-in kind (``ValueError``, ``ConnectionError``,
``RuntimeError``), so existing ``except ValueError`` code keeps working."""


class HFKVReuseError(Exception):
    """Base class of every error hf_kvreuse raises on purpose."""
