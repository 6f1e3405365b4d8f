"""Choice between the eager torch code and the Triton kernels (:mod:`hf_kvreuse.triton`).

The environment variable ``HF_KVREUSE_KERNELS`` picks the backend, read at each call:

``auto`` (default)
    Triton for CUDA tensors when ``triton`` imports, torch otherwise.
``torch``
    Always the eager torch code.
``triton``
    Always the Triton kernels; CPU tensors then need ``TRITON_INTERPRET=1`` (Triton's interpreter, slow: for
    tests), set before the first kernel call of the process.

Triton stays optional: importing this module (or :mod:`hf_kvreuse`) never imports it; it is imported on the
first call that needs it (installed by ``pip install hf_kvreuse[triton]``).
"""

from __future__ import annotations

import functools
import os

import torch

ENV_VAR = "HF_KVREUSE_KERNELS"
MODES = ("auto", "torch", "triton")
BACKENDS = ("torch", "triton")


def mode() -> str:
    """The value of ``HF_KVREUSE_KERNELS`` (default ``"auto"``); raises ``ValueError`` for any other value."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: choose one of {', '.join(MODES)}")
    return value


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether ``import triton`` succeeds (tried once per process)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def backend_name(device: torch.device | str) -> str:
    """``"torch"`` or ``"triton"``: the backend that runs for tensors on ``device`` under the current
    ``HF_KVREUSE_KERNELS`` (what a cache reports it used).

    Raises
    ------
    ValueError
        ``HF_KVREUSE_KERNELS`` holds an unknown value.
    RuntimeError
        ``HF_KVREUSE_KERNELS=triton`` but triton does not import, or the device is not CUDA and
        ``TRITON_INTERPRET=1`` is not set.
    """
    m = mode()
    if m == "torch":
        return "torch"
    cuda = torch.device(device).type == "cuda"
    if m == "auto":
        return "triton" if cuda and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton does not import: pip install 'hf_kvreuse[triton]', "
                           f"or set {ENV_VAR}=auto / torch")
    if not cuda and not _interpreting():
        raise RuntimeError(f"{ENV_VAR}=triton on a {torch.device(device).type} tensor needs Triton's interpreter: "
                           f"set TRITON_INTERPRET=1 before the first kernel call (or use {ENV_VAR}=auto / torch)")
    return "triton"


def backend(tensor: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"``: the backend for ``tensor`` (see :func:`backend_name`). Under ``auto`` a dtype
    the kernels do not support (not float32 / bfloat16 / float16) goes to torch."""
    name = backend_name(tensor.device)
    if name == "triton" and mode() == "auto" and tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "torch"
    return name


def rope_rebase(dst: torch.Tensor, src: torch.Tensor, delta: int | torch.Tensor, shifter) -> None:
    """``dst[:] = src`` with each token's key re-rotated by its position delta (int, ``[T]`` or ``[B, T]``),
    through the backend :func:`backend` picks for ``src``; see :mod:`hf_kvreuse.triton.rope_rebase`."""
    from .triton.rope_rebase import rope_rebase_torch, rope_rebase_triton

    if backend(src) == "triton":
        rope_rebase_triton(dst, src, delta, shifter)
    else:
        rope_rebase_torch(dst, src, delta, shifter)


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions, scaling: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of selected rows ``q`` ``[B, Hq, R, D]`` over ``k``/``v`` ``[B, Hkv, N, D]``, each row seeing the
    columns at positions up to its own (``positions``: a
    :class:`~hf_kvreuse.triton.selected_attention.SelectedPositions`), through the backend :func:`backend` picks
    for ``q``: the Triton kernel, or on torch SDPA block by block over the visible columns; see
    :mod:`hf_kvreuse.triton.selected_attention`. ``out`` (``[B, Hq, R, D]``, any strides) receives the result."""
    from .triton.selected_attention import selected_attention_blocked, selected_attention_triton

    q_pos, k_pos, k_valid = positions.on(q.device)
    if backend(q) == "triton":
        return selected_attention_triton(q, k, v, q_pos, k_pos, scaling, k_valid, out=out,
                                         block_m=positions.block_m, block_n=positions.block_n,
                                         ends=positions.ends(q.device))
    return selected_attention_blocked(q, k, v, q_pos, k_pos, scaling, k_valid, plan=positions.plan(q.device),
                                      out=out)
