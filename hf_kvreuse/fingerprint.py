"""Which model made a K/V: everything that determines its forward. A hash of every byte of every parameter, buffer
and packed quantized weight, every config field that changes K/V, and the state of every adapter layer (active,
disabled, merged, scaling). The one identity of sessions, the chunk store, its disk tier, the K/V store and
``donor_exact``.

K/V rows are exact for another call only if the same weights, the same K/V-relevant config (RoPE type, theta and
scaling, attention multipliers and scaling, head sizes, sliding windows, norms, ...) and the same adapters computed
them, so every reuse keys K/V by :func:`model_fingerprint` (portable: equal across processes for equal models) or,
within a process, by :func:`weights_state` (cheap, checked on every call); the K/V store shared with vLLM keys by
the weights files of a folder plus :func:`config_digest` of the config the engine runs (``hf_kvreuse.vllm.identity``).

* **every tensor the model reads**: each parameter's and each buffer's (persistent or not: rotary ``inv_freq``,
  GPTQ/AWQ ``qweight``, ``scales``, ``qzeros``) storage bytes are hashed with BLAKE2b (a cryptographic hash: no
  pattern of edits leaves it unchanged, unlike sums of words), together with its dtype and shape; a quantized
  tensor by its integer values, scales and zero points; the opaque packed weights of torch's quantized modules
  (``quantize_dynamic``'s int8 ``Linear``) through the module's own ``_weight_bias()``;
* **checked on every call**: :func:`weights_state` reads, for every tensor, its storage pointer, its version
  counter (torch bumps it on every in-place write through the tensor, ``load_state_dict`` and optimiser steps
  included; a new tensor has a new storage) and :data:`SAMPLES` elements at fixed strided positions
  (:func:`sample_positions`), gathered in one copy per device and dtype. The samples catch writes that bypass the
  version counter: through ``p.data`` (also after :func:`forget`), peft's ``merge_and_unload`` / ``merge_adapter``
  (``weight.data += delta``), ``torch.nn.utils`` helpers writing ``.data``. Each tensor's full digest is cached
  with that key, so :func:`model_fingerprint` re-hashes only tensors whose key changed. Measured cost per call:
  ``benchmarks/results/fingerprint_cost.json`` (``benchmarks/fingerprint_cost.py``);
* **what stays invisible**: a write that bypasses the version counter (``p.data``, ``.detach()`` views, a tensor
  shared with numpy or DLPack, a CUDA kernel writing the storage) *and* changes none of a tensor's sampled
  elements (e.g. ``p.data[3, 5] = x`` at an unsampled position, a sparse edit of a few rows); a packed quantized
  weight changed inside its packed object (``set_weight_bias`` makes a new one and is seen); an offloaded
  parameter (on ``meta``) whose offload map is edited. After such a write call :func:`forget` (the next
  :func:`model_fingerprint` re-hashes every byte) and :meth:`~hf_kvreuse.ReuseSession.clear` the sessions of this
  model (their held K/V came from the old weights), or write through ``p`` itself under ``torch.no_grad()``
  (``p.copy_``, ``p.add_``: the version counter is bumped and everything is seen);
* **adapters**: every peft tuner layer's active adapters, disabled flag, merged adapters, ``use_dora`` and
  per-adapter ``scaling`` (``set_scale``, ``scale_layer``, ``rescale_adapter_scale`` change only that);
* **config**: :func:`kv_config` keeps every config field except those that cannot change K/V (token ids, names,
  generation settings, output flags); an unknown field is kept, so a new model family's multiplier counts;
* **producer tags**: :func:`tag_producer` stamps each returned cache with the model object and its
  :func:`weights_state`; :func:`made_by` recognises this model's own cache with its present state,
  :func:`stale_producer` one made with other weights or adapters, and
  :func:`hf_kvreuse.model_check.check_exact_donor` refuses such a donor (or an untagged one whose K/V the model
  does not compute) as an exact prefix;
* work on **offloaded** models: a parameter on ``meta`` (accelerate's offload) is read from its hook's weights map.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import weakref

import torch

_CHUNK_BYTES = 1 << 26  # bytes moved to the CPU and hashed per step (a GPU parameter is copied in pieces)
#: elements of each tensor read on every identity check (:func:`sample_positions`)
SAMPLES = 16
#: id(tensor or quantized module) -> (weak reference to it, version key or packed object, digest)
_DIGESTS: dict[int, tuple] = {}

#: config fields that cannot change the K/V a forward computes (ids of special tokens, names, generation and output
#: settings); every other field, known or not, is part of the identity
NOT_KV_FIELDS = frozenset({
    "architectures", "transformers_version", "name_or_path", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "torchscript", "tie_word_embeddings", "id2label", "label2id", "task_specific_params", "problem_type",
    "tokenizer_class", "prefix", "finetuning_task", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "chunk_size_feed_forward", "tf_legacy_loss", "use_bfloat16", "torch_dtype", "dtype",
    "pruned_heads", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "is_encoder_decoder",
    "output_router_logits", "router_aux_loss_coef", "initializer_range", "use_return_dict", "num_labels",
})


def kv_config(config) -> dict:
    """The fields of ``config`` (a ``PretrainedConfig`` or a dict) that can change the K/V a forward computes.

    Everything except :data:`NOT_KV_FIELDS` and private (``_``-prefixed) fields, sub-configs included. The dtype is
    not a config field here: it is part of the weights' digest (and of the K/V store's identity)."""
    d = config if isinstance(config, dict) else config.to_dict()

    def keep(x):
        if isinstance(x, dict):
            return {str(k): keep(v) for k, v in x.items() if not str(k).startswith("_") and k not in NOT_KV_FIELDS}
        if isinstance(x, (list, tuple)):
            return [keep(v) for v in x]
        if isinstance(x, float) and x.is_integer():
            return int(x)  # 10000 and 10000.0 are one theta
        return x

    return keep(d)


def config_digest(config) -> str:
    """sha256 of :func:`kv_config` (canonical JSON): equal for two configs whose K/V-relevant fields are equal."""
    body = json.dumps(kv_config(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def tensor_digest(t: torch.Tensor) -> bytes:
    """BLAKE2b (16 bytes) of every byte of ``t`` with its dtype and shape; a GPU tensor is copied to the CPU in
    pieces of :data:`_CHUNK_BYTES`. A quantized tensor: its integer values, quantization scheme, scales and zero
    points."""
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    if t.is_quantized:
        scheme = t.qscheme()
        h.update(str(scheme).encode())
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            h.update(repr((float(t.q_scale()), int(t.q_zero_point()))).encode())
        else:
            h.update(repr(t.q_per_channel_axis()).encode())
            h.update(tensor_digest(t.q_per_channel_scales()))
            h.update(tensor_digest(t.q_per_channel_zero_points()))
        h.update(tensor_digest(t.int_repr()))
        return h.digest()
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_zeros(0, dtype=torch.uint8)
    for piece in raw.split(_CHUNK_BYTES):
        h.update(piece.cpu().numpy().data)
    return h.digest()


def _offloaded_value(module, name: str) -> torch.Tensor | None:
    """The value accelerate keeps for a parameter that lives on ``meta`` between forwards (None if not found)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
        wmap = getattr(h, "weights_map", None)
        if wmap is not None:
            try:
                return wmap[name]
            except KeyError:
                continue
    return None


def _version(p: torch.Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # an inference-mode tensor has no version counter: treated as never written in place
        return -1


#: module attributes that hold the opaque packed weights of torch's quantized modules (``torch.ScriptObject``)
_PACKED_ATTRS = ("_packed_params", "_packed_weight")


def _tensors(model) -> tuple[list, list]:
    """Every tensor ``model``'s forward reads: ``[(module, qualified name, local name, tensor)]`` for each parameter
    and each buffer (persistent or not) of every module, and ``[(module, qualified name, packed object)]`` for
    the packed weights of torch's quantized modules (dynamic-int8 ``Linear`` keeps its weight in a
    ``LinearPackedParams`` whose ``_packed_params`` is a ``torch.ScriptObject``, not a tensor)."""
    tensors, packed = [], []
    for mod_name, module in model.named_modules():
        for name, p in module._parameters.items():
            if p is not None:
                tensors.append((module, f"{mod_name}.{name}", name, p))
        for name, b in module._buffers.items():
            if b is not None:
                tensors.append((module, f"{mod_name}.{name}", name, b))
        d = module.__dict__
        for attr in _PACKED_ATTRS:
            obj = d.get(attr)
            if isinstance(obj, torch.ScriptObject):
                packed.append((module, f"{mod_name}.{attr}", obj))
    return tensors, packed


@functools.lru_cache(maxsize=4096)
def sample_positions(numel: int, last_dim: int = 1, k: int = SAMPLES) -> range:
    """The flat positions of a tensor of ``numel`` elements whose values are read on every identity check: all of
    them up to ``k``, else ``k`` positions at a fixed stride over the whole tensor, the first one included. The
    stride is made coprime with the last dimension (``last_dim``), so the samples of a matrix fall in different
    rows and columns, not down one column."""
    if numel <= k:
        return range(numel)
    step = max(1, numel // k)
    while step > 1 and math.gcd(step, max(1, last_dim)) != 1:
        step += 1
    return range(0, numel, step)[:k]


def _sample_view(t: torch.Tensor) -> torch.Tensor | None:
    """The sampled elements of ``t`` as one flat tensor (a view where ``t`` is contiguous), or None for a tensor
    with no values here (``meta``: offloaded) or no elements."""
    n = t.numel()
    if n == 0 or t.device.type == "meta":
        return None
    if t.is_quantized:
        t = t.int_repr()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    r = sample_positions(t.numel(), t.shape[-1] if t.dim() else 1)
    return t.reshape(-1)[r.start:r.stop:r.step]  # under no_grad (the caller's): a view that records no graph


@torch.no_grad()
def _samples(tensors: list) -> list[bytes]:
    """The bytes of each tensor's sampled elements (:func:`sample_positions`), read in one copy per device and
    dtype (a GPU model: one small device-to-host copy per dtype)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        v = _sample_view(t)
        if v is not None:
            groups.setdefault((v.device, v.dtype), []).append((i, v))
    out = [b""] * len(tensors)
    for items in groups.values():
        joined = torch.cat([v for _, v in items])
        data = joined.view(torch.uint8).cpu().numpy().tobytes()
        size, at = joined.element_size(), 0
        for i, v in items:
            n = v.numel() * size
            out[i] = data[at:at + n]
            at += n
    return out


def _param_digest(module, name: str, p: torch.Tensor, sample: bytes = b"") -> bytes:
    """The cached :func:`tensor_digest` of ``p``, recomputed when its storage, version, shape, dtype, device or
    sampled elements changed."""
    key = (p.data_ptr(), _version(p), tuple(p.shape), p.dtype, p.device, sample)
    hit = _DIGESTS.get(id(p))
    if hit is not None and hit[0]() is p and hit[1] == key:
        return hit[2]
    if p.device.type == "meta":
        value = _offloaded_value(module, name)
        digest = tensor_digest(value) if value is not None else f"meta{tuple(p.shape)}{p.dtype}".encode()
    else:
        digest = tensor_digest(p)
    pid = id(p)
    _DIGESTS[pid] = (weakref.ref(p, lambda _, pid=pid: _DIGESTS.pop(pid, None)), key, digest)
    return digest


def _packed_digest(module, obj) -> bytes:
    """The digest of a quantized module's packed weights, read through the module's own accessor
    (``_weight_bias()``, or ``_weight()`` of packed embeddings), cached per packed object (``set_weight_bias``
    makes a new one). A packed object without an accessor is named by its identity in this process (never equal
    across processes: a session saved with it does not load elsewhere)."""
    hit = _DIGESTS.get(id(module))
    if hit is not None and hit[0]() is module and hit[1] is obj:
        return hit[2]
    reader = getattr(module, "_weight_bias", None) or getattr(module, "_weight", None)
    if reader is None:
        digest = f"opaque{type(obj)}{id(obj)}".encode()
    else:
        parts = reader()
        h = hashlib.blake2b(digest_size=16)
        for t in parts if isinstance(parts, (tuple, list)) else (parts,):
            h.update(b"none" if t is None else tensor_digest(t))
        digest = h.digest()
    mid = id(module)
    _DIGESTS[mid] = (weakref.ref(module, lambda _, mid=mid: _DIGESTS.pop(mid, None)), obj, digest)
    return digest


def forget(model) -> None:
    """Drop the cached digests of ``model``'s tensors and packed weights: the next :func:`model_fingerprint` hashes
    every byte again. Needed only after a write that the per-call check cannot see (module docstring: it bypasses
    the version counter and changes no sampled element); every other write is seen without it."""
    tensors, packed = _tensors(model)
    for _, _, _, t in tensors:
        _DIGESTS.pop(id(t), None)
    for module, _, _ in packed:
        _DIGESTS.pop(id(module), None)


def model_fingerprint(model) -> str:
    """The identity of the K/V ``model`` computes: every byte of every parameter, buffer and packed quantized
    weight, :func:`config_digest` of its config and the state of every peft tuner layer (active, disabled,
    merged, scaling). 16 hex digits.

    Each tensor's BLAKE2b is cached with its storage, version and sampled elements (a call re-hashes only tensors
    whose key changed); the writes this cannot see, and the measured cost, in the module docstring."""
    tensors, packed = _tensors(model)
    samples = _samples([t for *_, t in tensors])
    h = hashlib.sha256(config_digest(model.config).encode())
    for (module, qual, name, t), sample in zip(tensors, samples):
        h.update(qual.encode())
        h.update(_param_digest(module, name, t, sample))
    for module, qual, obj in packed:
        h.update(qual.encode())
        h.update(_packed_digest(module, obj))
    h.update(_adapter_state(model).encode())
    return h.hexdigest()[:16]


def _plain(x):
    """``x`` (an adapter setting: a number, a tensor, a dict or list of them) as a value ``repr`` gives exactly."""
    if isinstance(x, dict):
        return sorted((str(k), _plain(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else tensor_digest(x).hex()
    return x


#: per-adapter settings of a peft tuner layer that change its forward without touching a tensor
_ADAPTER_SETTINGS = ("scaling", "use_dora", "merged_adapters")


@functools.lru_cache(maxsize=None)
def _may_tune(cls) -> bool:
    """Whether instances of ``cls`` may be peft tuner layers: the class defines ``active_adapters`` and
    ``disable_adapters`` as non-callables (peft's properties), or comes from peft (which might set them on the
    instance). Other modules are skipped without an attribute lookup on each instance."""
    active, disabled = getattr(cls, "active_adapters", None), getattr(cls, "disable_adapters", None)
    if active is not None and disabled is not None and not callable(active) and not callable(disabled):
        return True
    return cls.__module__.split(".")[0] == "peft"


def _adapter_state(model) -> str:
    """The state of every peft tuner layer (LoRA and the other tuners), named by its module path: its active
    adapters, whether adapters are disabled, and :data:`_ADAPTER_SETTINGS` (merged adapters, DoRA, the
    per-adapter ``scaling`` that ``set_scale``, ``scale_layer`` and ``rescale_adapter_scale`` change).
    transformers' own ``active_adapters`` / ``disable_adapters`` are methods, not state: skipped."""
    rows = []
    for name, module in model.named_modules():
        if not _may_tune(type(module)):
            continue
        active = getattr(module, "active_adapters", None)
        disabled = getattr(module, "disable_adapters", None)
        if active is None or disabled is None or callable(active) or callable(disabled):
            continue
        rows.append([name, list(active), bool(disabled)] + [_plain(getattr(module, a, None)) for a in _ADAPTER_SETTINGS])
    return repr(rows) if rows else ""


def weights_state(model) -> tuple:
    """A cheap token of everything that determines ``model``'s forward *now*, in this process:
    ``(tensors, adapters, config)``. ``tensors``: every parameter's and buffer's storage and version, a digest
    of their sampled elements (:func:`sample_positions`) and the packed quantized weights' objects; ``adapters``:
    the state of every peft tuner layer; ``config``: :func:`config_digest`.

    Equal tokens mean nothing the identity sees was written since (what it cannot see: module docstring).
    :func:`tag_producer` stamps it on the caches a model returns, so a donor that this model made with its
    present weights is recognised without a probe, and one made with other weights, adapters or config is known
    (:func:`stale_producer`)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    tensors, packed = _tensors(target)
    samples = _samples([t for *_, t in tensors])
    # a new or replaced tensor has a new storage (a new dtype, shape or device included): storage and version
    # name it; the samples see writes that bypass the version counter
    where = tuple((t.data_ptr(), _version(t)) for *_, t in tensors)
    seen = hashlib.blake2b(b"".join(samples), digest_size=16).digest()
    tensors_token = (where, seen, tuple(id(obj) for *_, obj in packed))
    return (tensors_token, _adapter_state(target), config_digest(target.config))


_PRODUCER_ATTR = "_hf_kvreuse_producer"


def tag_producer(cache, model) -> None:
    """Record on ``cache`` which model (and weights state) computed its K/V (see :func:`made_by`)."""
    if cache is not None:
        try:
            setattr(cache, _PRODUCER_ATTR, (weakref.ref(model), weights_state(model)))
        except (AttributeError, TypeError):  # a cache type that takes no attributes: it is probed instead
            pass


def made_by(cache, model) -> bool:
    """True when ``cache`` was returned by a ``generate`` of ``model`` with the weights and adapters it has now."""
    tag = getattr(cache, _PRODUCER_ATTR, None)
    return tag is not None and tag[0]() is model and tag[1] == weights_state(model)


_STATE_PARTS = ("other weights (a parameter, buffer or packed weight written, replaced or merged since)",
                "another adapter state (active, disabled or merged adapters, or LoRA scaling)",
                "another config")


def stale_producer(cache, *models) -> str | None:
    """Why ``cache`` is known *not* to be the K/V of ``models`` as they are now: its producer tag names one of
    these model objects with a :func:`weights_state` other than its present one (the reason says which part
    differs). None where the cache has no tag, was made by another object (it is probed instead), or was made
    with the present state."""
    tag = getattr(cache, _PRODUCER_ATTR, None)
    if tag is None:
        return None
    for model in models:
        if model is not None and tag[0]() is model:
            now = weights_state(model)
            if now == tag[1]:
                return None
            return " and ".join(w for w, a, b in zip(_STATE_PARTS, tag[1], now) if a != b) or _STATE_PARTS[0]
    return None
