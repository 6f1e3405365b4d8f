"""Choice between the eager torch code and the Triton kernels (:mod:`hf_kvreuse.triton`).

The environment variable ``HF_KVREUSE_KERNELS`` picks the backend, read at each call:

``auto`` (default)
    For CUDA tensors, when ``triton`` imports: measured. The first call of each kernel for a (device name,
    dtype, shape bucket) runs the Triton and torch paths on scratch copies, keeps only a path whose result
    equals the torch reference, times them and keeps the faster (:mod:`hf_kvreuse.dispatch`; the choices are
    cached in memory and on disk, and reported in the caches' ``stats.kernels``). Torch otherwise.
``torch``
    Always the eager torch code.
``triton``
    Always the Triton kernels; CPU tensors then need ``TRITON_INTERPRET=1`` (Triton's interpreter, slow: for
    tests), set before triton is first imported (transformers imports it: set it before importing
    transformers or hf_kvreuse, e.g. in the environment): triton's library functions (``tl.sum``, ``tl.max``)
    are built for the interpreter only then.

Triton stays optional: importing this module (or :mod:`hf_kvreuse`) never imports it; it is imported on the
first call that needs it (installed by ``pip install hf_kvreuse[triton]``).
"""

from __future__ import annotations

import functools
import os

import torch

from .dispatch import dispatcher

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
        # "triton" here means: the kernel functions below choose, measured (see measured())
        return "triton" if triton_available() and (cuda or (dispatcher().measure_cpu and _interpreting())) \
            else "torch"
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


def measured(name: str, kernel: str, tensor: torch.Tensor, shape: tuple[int, ...], paths: dict) -> str:
    """The backend a kernel call runs on: ``name`` (from :func:`backend`) unless it is ``"triton"`` under
    ``auto``, where the measured choice for (``kernel``, ``tensor``'s device and dtype, ``shape``'s bucket)
    decides (:meth:`hf_kvreuse.dispatch.Dispatcher.choose`; ``paths`` maps each backend to a call on scratch
    arguments)."""
    if name != "triton" or mode() != "auto":
        return name
    return dispatcher().choose(kernel, tensor.device, tensor.dtype, tuple(shape), paths)


def describe(device: torch.device | str) -> str:
    """What ``stats.kernels`` reports for a call on ``device``: ``"torch"`` or ``"triton"`` when forced or when
    nothing is measured there, else ``"auto(kernel=backend, ...)"``: the backend each kernel last ran on."""
    name = backend_name(device)
    if name == "triton" and mode() == "auto":
        return dispatcher().describe(torch.device(device))
    return name


def _scratch(fn, *args):
    """Run ``fn(out, *args)`` on a fresh output like ``args[0]`` and return the output."""
    out = torch.empty_like(args[0])
    fn(out, *args)
    return out


def rope_rebase(dst: torch.Tensor, src: torch.Tensor, delta: int | torch.Tensor, shifter) -> None:
    """``dst[:] = src`` with each token's key re-rotated by its position delta (int, ``[T]`` or ``[B, T]``),
    through the backend :func:`backend` picks for ``src``; see :mod:`hf_kvreuse.triton.rope_rebase`."""
    from .triton.rope_rebase import rope_rebase_torch, rope_rebase_triton

    paths = dict(torch=lambda: _scratch(rope_rebase_torch, src, delta, shifter),
                 triton=lambda: _scratch(rope_rebase_triton, src, delta, shifter))
    if measured(backend(src), "rope_rebase", src, src.shape, paths) == "triton":
        rope_rebase_triton(dst, src, delta, shifter)
    else:
        rope_rebase_torch(dst, src, delta, shifter)


# --- row gather / scatter and token deviation (hf_kvreuse.triton.gather_scatter, .deviation) ---

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _backend_all(*tensors: torch.Tensor) -> str:
    """:func:`backend` of the first tensor; under ``auto`` torch as soon as any of them has a dtype the kernels do
    not support (an explicit ``triton`` lets the kernel raise instead)."""
    name = backend(tensors[0])
    if name == "triton" and mode() == "auto" and any(t.dtype not in _KERNEL_DTYPES for t in tensors):
        return "torch"
    return name


def gather_kv_rows(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k.index_select(-2, rows), v.index_select(-2, rows))``, through the backend :func:`backend` picks for
    ``k`` (Triton: K and V in one launch); see :mod:`hf_kvreuse.triton.gather_scatter`."""
    from .triton import gather_scatter as gs

    paths = dict(torch=lambda: gs.gather_kv_rows_torch(k, v, rows), triton=lambda: gs.gather_kv_rows_triton(k, v, rows))
    if measured(_backend_all(k, v), "gather_kv_rows", k, (*k.shape, rows.numel()), paths) == "triton":
        return gs.gather_kv_rows_triton(k, v, rows)
    return gs.gather_kv_rows_torch(k, v, rows)


def scatter_kv_rows(dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor,
                    check: bool = True) -> None:
    """In place ``dk.index_copy_(-2, rows, sk.to(dk.dtype))`` and the same for V, through the backend
    :func:`backend` picks for ``dk`` (Triton: K and V in one launch, cast on store; ``check=False`` skips its
    host-synchronising range check of ``rows`` when the caller has done it); see
    :mod:`hf_kvreuse.triton.gather_scatter`."""
    from .triton import gather_scatter as gs

    def scratch(fn, **kw):
        a, b = dk.clone(), dv.clone()
        fn(a, b, rows, sk, sv, **kw)
        return a, b

    paths = dict(torch=lambda: scratch(gs.scatter_kv_rows_torch),
                 triton=lambda: scratch(gs.scatter_kv_rows_triton, check=check))
    if measured(_backend_all(dk, dv, sk, sv), "scatter_kv_rows", dk, (*dk.shape, rows.numel()), paths) == "triton":
        gs.scatter_kv_rows_triton(dk, dv, rows, sk, sv, check=check)
    else:
        gs.scatter_kv_rows_torch(dk, dv, rows, sk, sv)


def _deviation_backend(new: torch.Tensor, old: torch.Tensor, upcast: bool, norm: bool) -> str:
    from .triton import deviation as dv

    paths = dict(torch=lambda: dv.token_deviation_torch(new, old, upcast=upcast, norm=norm),
                 triton=lambda: dv.token_deviation_triton(new, old, upcast=upcast, norm=norm))
    kernel = "token_deviation" + ("_upcast" if upcast else "") + ("_norm" if norm else "")
    return measured(_backend_all(new, old), kernel, new, new.shape, paths)


def token_deviation(new: torch.Tensor, old: torch.Tensor, upcast: bool = False,
                    norm: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``sum_{b,h,d} (new - old)^2`` in float32 ``[T]`` (and ``sum new^2`` with ``norm=True``), through
    the backend :func:`backend` picks for ``new``; see :mod:`hf_kvreuse.triton.deviation`."""
    from .triton import deviation as dv

    if _deviation_backend(new, old, upcast, norm) == "triton":
        return dv.token_deviation_triton(new, old, upcast=upcast, norm=norm)
    return dv.token_deviation_torch(new, old, upcast=upcast, norm=norm)


def deviation_topk(new: torch.Tensor, old: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """CacheBlend's selection: the ``k`` rows of ``candidates`` with the largest :func:`token_deviation`, the
    deviation through the backend :func:`backend` picks for ``new``; see
    :func:`hf_kvreuse.triton.deviation.deviation_topk`."""
    from .triton import deviation as dv

    return dv.deviation_topk(new, old, candidates, k, use_triton=_deviation_backend(new, old, False, False) == "triton")


def lowrank_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, L: torch.Tensor,
                      Bw: torch.Tensor, s: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float) -> torch.Tensor:
    """PReCache's low-rank value attention ``P·V_base + s·(P·L)·B`` (``[B, q, H, D]``), through the backend
    :func:`backend` picks for ``value``; see :mod:`hf_kvreuse.triton.lowrank_attention`."""
    from .triton.lowrank_attention import lowrank_attention_torch, lowrank_attention_triton

    # under auto the choice is measured per shape bucket (decode-sized queries ran at 0.76-0.80x the torch path on
    # an H200, prefill 3.5-4.1x faster: benchmarks/results/gpu/gpu_check.json)
    args = (query, key, value, L, Bw, s, attention_mask, scaling)
    paths = dict(torch=lambda: lowrank_attention_torch(*args), triton=lambda: lowrank_attention_triton(*args))
    shape = (*query.shape, key.shape[2], L.shape[-1], attention_mask is not None)
    if measured(backend(value), "lowrank_attention", value, shape, paths) == "triton":
        return lowrank_attention_triton(query, key, value, L, Bw, s, attention_mask, scaling)
    return lowrank_attention_torch(query, key, value, L, Bw, s, attention_mask, scaling)


#: tile variants of the selected-row attention kernel that measured ``auto`` tries beside its default tiles
#: (:func:`hf_kvreuse.triton.sizing.attention_tiles`): 16-row tiles (the decode tiling) and 32-column key tiles (the
#: low-rank kernel's), both no larger than the defaults the compile check found to compile without a spill on sm_80
#: and sm_90 (shared memory is fitted to the target by the same rule); ``None`` keeps the default of that side
SELECTED_TILE_VARIANTS = {"bm16": (16, None), "bn32": (None, 32)}


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions, scaling: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of selected rows ``q`` ``[B, Hq, R, D]`` over ``k``/``v`` ``[B, Hkv, N, D]``, each row seeing the
    columns at positions up to its own (``positions``: a
    :class:`~hf_kvreuse.triton.selected_attention.SelectedPositions`), through the backend :func:`backend` picks
    for ``q``: the Triton kernel, or on torch SDPA block by block over the visible columns; see
    :mod:`hf_kvreuse.triton.selected_attention`. ``out`` (``[B, Hq, R, D]``, any strides) receives the result."""
    from .triton.selected_attention import selected_attention_blocked, selected_attention_triton

    q_pos, k_pos, k_valid = positions.on(q.device)

    def run_triton(out=None):
        return selected_attention_triton(q, k, v, q_pos, k_pos, scaling, k_valid, out=out, block_m=positions.block_m,
                                         block_n=positions.block_n, ends=functools.partial(positions.ends, q.device))

    def run_triton_tiles(block_m, block_n, out=None):
        return selected_attention_triton(q, k, v, q_pos, k_pos, scaling, k_valid, out=out, block_m=block_m,
                                         block_n=block_n, ends=functools.partial(positions.ends, q.device))

    def run_torch(out=None):
        return selected_attention_blocked(q, k, v, q_pos, k_pos, scaling, k_valid, plan=positions.plan(q.device),
                                          out=out)

    paths = dict(torch=run_torch, triton=run_triton)
    if positions.block_m is None and positions.block_n is None:  # tile variants, measured like the backends
        for name, (bm, bn) in SELECTED_TILE_VARIANTS.items():
            paths[f"triton:{name}"] = functools.partial(run_triton_tiles, bm, bn)
    choice = measured(backend(q), "selected_attention", q, (*q.shape, k.shape[1], k.shape[2]), paths)
    if choice == "triton":
        return run_triton(out)
    if choice.startswith("triton:"):
        return run_triton_tiles(*SELECTED_TILE_VARIANTS[choice.split(":", 1)[1]], out=out)
    return run_torch(out)
