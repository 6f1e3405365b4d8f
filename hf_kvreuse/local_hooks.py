"""Changes to a model that only the calling context sees: forward hooks, patched forwards, the attention swap.

Some of the library's methods run code inside a model's forward: a hook that stops after layer 0 (the donor
probe of :func:`hf_kvreuse.model_check.check_donor`), peft's per-row adapter names (BaseLRCache's mixed rows), a
latent bridge's LoRA on the latent rows, the capture of normalised hidden states (TranslatedCache's source
prefill), a k/v projection split into base and low-rank parts, or an attention function that adds low-rank
values or attends by selected position. Module hooks, module attributes and ``config._attn_implementation`` are
shared by every thread that runs the model, so each of these is made *local*:

- :class:`LocalHooks` registers forward (pre-)hooks that act only in the context (thread or asyncio task) that
  opened the block; in every other context they return at once and change nothing.
- :func:`patched_forward` replaces a module's ``forward`` by a function that must itself fall back to the
  module's own forward outside its context; the patch is reference-counted across threads, so one call's exit
  never removes it under another call still running.
- :func:`wrapped_attention` selects the library's one attention implementation, ``kvreuse_<base>``, registered
  with transformers' ``AttentionInterface`` for ``base`` in ``sdpa`` / ``eager`` with ``base``'s own mask builder.
  It calls the wrappers registered with :func:`register_wrapper` (selected-row attention, low-rank values), each
  of which acts only while its own context variable is set in the calling context and otherwise calls ``base``
  with the mask the engine passed. The swap is reference-counted per config across threads and restored by the
  last call out, in any order of exits, so a plain ``generate`` of the same model in another thread computes what
  ``base`` computes; only the name ``config._attn_implementation`` reads differs meanwhile
  (:func:`base_attn` gives the model's own).

No lock is needed for the forwards: nothing installed here changes what another context's forward computes.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from typing import Callable

ATTN_PREFIX = "kvreuse_"

_SCOPES: contextvars.ContextVar = contextvars.ContextVar("hf_kvreuse_local_scopes", default=frozenset())
_IDS = itertools.count()


class LocalHooks:
    """Forward hooks active only in the context that opened :func:`local_hooks` (removed when it closes)."""

    def __init__(self):
        self.scope = next(_IDS)
        self.handles: list = []

    def active(self) -> bool:
        """Whether the calling context is this block's."""
        return self.scope in _SCOPES.get()

    def forward(self, module, hook: Callable):
        """``module.register_forward_hook(hook)``, a no-op in every other context."""
        def local(mod, args, out):
            return hook(mod, args, out) if self.scope in _SCOPES.get() else None
        self.handles.append(module.register_forward_hook(local))

    def pre(self, module, hook: Callable, with_kwargs: bool = False):
        """``module.register_forward_pre_hook(hook, with_kwargs=...)``, a no-op in every other context."""
        if with_kwargs:
            def local(mod, args, kwargs):
                return hook(mod, args, kwargs) if self.scope in _SCOPES.get() else None
        else:
            def local(mod, args):
                return hook(mod, args) if self.scope in _SCOPES.get() else None
        self.handles.append(module.register_forward_pre_hook(local, with_kwargs=with_kwargs))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@contextlib.contextmanager
def local_hooks():
    """Yield a :class:`LocalHooks`; its hooks act in this context only and are removed when the block exits."""
    hooks = LocalHooks()
    token = _SCOPES.set(_SCOPES.get() | {hooks.scope})
    try:
        yield hooks
    finally:
        hooks.remove()
        _SCOPES.reset(token)


_PATCH_LOCK = threading.Lock()
_PATCHES: dict[int, list] = {}  # id(module) -> [calls holding the patch, the patched function]


@contextlib.contextmanager
def patched_forward(modules_and_forwards):
    """For the block, ``module.forward`` is the given function for each ``(module, make_forward)`` pair
    (``make_forward(module)`` builds it once, for the first call in; it must fall back to the module's own forward
    outside its own context). Reference-counted across threads: the last call out removes it."""
    held = []
    try:
        with _PATCH_LOCK:
            for module, make in modules_and_forwards:
                entry = _PATCHES.get(id(module))
                if entry is None:
                    if "forward" in module.__dict__:
                        raise RuntimeError(f"{type(module).__name__} already has an instance forward (patched by "
                                           "other code): refusing to replace it")
                    entry = _PATCHES[id(module)] = [0, make(module)]
                    module.forward = entry[1]
                entry[0] += 1
                held.append(module)
        yield
    finally:
        with _PATCH_LOCK:
            for module in held:
                entry = _PATCHES[id(module)]
                entry[0] -= 1
                if entry[0] == 0:
                    if module.__dict__.get("forward") is entry[1]:
                        del module.__dict__["forward"]
                    del _PATCHES[id(module)]


# -- the attention swap -------------------------------------------------------------------------------------------
_WRAPPERS: dict[str, tuple[int, Callable]] = {}  # name -> (order, wrap(base_fn) -> fn); lower order = outer
_ACTIVE: dict[str, Callable[[], bool]] = {}  # name -> whether the wrapper acts in the calling context
_COMPOSED: dict[tuple, Callable] = {}
_SWAP_LOCK = threading.Lock()
_SWAPS: dict[int, list] = {}  # id(config) -> [calls holding the swap, the implementation to restore]


def register_wrapper(name: str, wrap: Callable, order: int, active: Callable[[], bool]) -> None:
    """Add ``wrap(base_fn) -> attention_fn`` to the library's attention (``order``: lower runs outside). The
    function it returns must call ``base_fn`` unchanged unless ``active()`` (its own context variable is set in
    the calling context)."""
    with _SWAP_LOCK:
        if _WRAPPERS.get(name, (order, wrap))[1] is not wrap:
            raise ValueError(f"attention wrapper {name!r} is already registered")
        _WRAPPERS[name] = (order, wrap)
        _ACTIVE[name] = active


def others_active(name: str) -> bool:
    """Whether a wrapper other than ``name`` acts in the calling context (an outer wrapper then passes the call
    on with the real mask rather than replacing the attention)."""
    return any(n != name and act() for n, act in _ACTIVE.items())


def _dispatch(base_fn: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        key_ = (id(base_fn), len(_WRAPPERS))  # wrappers are only ever added: their count names the chain
        fn = _COMPOSED.get(key_)
        if fn is None:
            fn = base_fn
            for _, (_, wrap) in reversed(sorted(_WRAPPERS.items(), key=lambda kv: kv[1][0])):
                fn = wrap(fn)
            _COMPOSED[key_] = fn
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def library_attention(base_name: str) -> str:
    """Register (once) the library's attention over ``base_name`` (``"sdpa"``, ``"eager"`` or another registered
    implementation); return its name."""
    from .compat import register_attention_wrapper

    return register_attention_wrapper(ATTN_PREFIX + base_name, base_name, _dispatch)


def base_attn(config) -> str | None:
    """The model's own attention implementation (seen through a swap in progress)."""
    attn = getattr(config, "_attn_implementation", None)
    if attn is not None and attn.startswith(ATTN_PREFIX):
        return attn[len(ATTN_PREFIX):]
    return attn


@contextlib.contextmanager
def wrapped_attention(model):
    """For the block the model's attention is the library's (``kvreuse_<base>``); see the module docstring."""
    config = model.config
    name = library_attention(base_attn(config) or "eager")
    with _SWAP_LOCK:
        entry = _SWAPS.get(id(config))
        if entry is None:
            entry = _SWAPS[id(config)] = [0, config._attn_implementation]
            config._attn_implementation = name
        entry[0] += 1
    try:
        yield name
    finally:
        with _SWAP_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                if config._attn_implementation == name:  # else someone set another one since: keep it
                    config._attn_implementation = entry[1]
                del _SWAPS[id(config)]
