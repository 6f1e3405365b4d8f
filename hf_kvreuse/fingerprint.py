"""Which model made a K/V: its weights (a hash of every byte of every parameter), every config field that changes
K/V, and the active adapters. The one identity of sessions, the chunk store, its disk tier and the K/V store.

K/V rows are exact for another call only if the same weights, the same K/V-relevant config (RoPE type, theta and
scaling, attention multipliers and scaling, head sizes, sliding windows, norms, ...) and the same active adapters
computed them, so every reuse keys K/V by :func:`model_fingerprint`; the K/V store shared with vLLM keys by the
weights files of a folder plus :func:`config_digest` of the config the engine runs (``hf_kvreuse.vllm.identity``).

* **every byte**: each parameter's storage bytes are hashed with BLAKE2b (a cryptographic hash: no pattern of
  edits leaves it unchanged, unlike sums of words), together with its dtype and shape;
* **cheap per call**: each parameter's digest is kept with the parameter's version (torch bumps a tensor's
  ``_version`` on every in-place write, ``load_state_dict`` and optimiser steps included; a new tensor has a new
  storage), so a call re-reads only parameters that changed since. A write through ``p.data`` bypasses the
  version counter: call :func:`forget` (or write through ``p`` under ``torch.no_grad()``) after one.
  Measured on SmolLM2-135M (fp32, 2-core CPU,
  under load): first call 0.59 s (the old row/column sums: 0.35 s), a cached call 2.7 ms
  (``benchmarks/fingerprint_cost.py``);
* **config**: :func:`kv_config` keeps every config field except those that cannot change K/V (token ids, names,
  generation settings, output flags); an unknown field is kept, so a new model family's multiplier counts;
* work on **offloaded** models: a parameter on ``meta`` (accelerate's offload) is read from its hook's weights map.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

_CHUNK_BYTES = 1 << 26  # bytes moved to the CPU and hashed per step (a GPU parameter is copied in pieces)
#: id(parameter) -> (weak reference to it, version key, digest); tensors compare elementwise, so no WeakKeyDictionary
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
    pieces of :data:`_CHUNK_BYTES`."""
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
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


def _param_digest(module, name: str, p: torch.Tensor) -> bytes:
    key = (p.data_ptr(), _version(p), tuple(p.shape), p.dtype, p.device)
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


def forget(model) -> None:
    """Drop the cached digests of ``model``'s parameters (after writes through ``p.data``, which torch does not
    count as a new version)."""
    for p in model.parameters():
        _DIGESTS.pop(id(p), None)


def model_fingerprint(model) -> str:
    """The identity of the K/V ``model`` computes: every byte of every parameter, :func:`config_digest` of its config
    and, for peft-wrapped models, which adapters are active or disabled. 16 hex digits.

    Each parameter's BLAKE2b is cached with its version (a call re-hashes only parameters written since); measured
    cost in the module docstring."""
    h = hashlib.sha256(config_digest(model.config).encode())
    for mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            h.update(f"{mod_name}.{name}".encode())
            h.update(_param_digest(module, name, p))
    h.update(_adapter_state(model).encode())
    return h.hexdigest()[:16]


def _adapter_state(model) -> str:
    """Which peft adapters a tuner layer runs (the first LoRA-style layer speaks for all: peft switches them
    together). transformers' own ``active_adapters`` / ``disable_adapters`` are methods, not state: skipped."""
    for module in model.modules():
        active = getattr(module, "active_adapters", None)
        disabled = getattr(module, "disable_adapters", None)
        if active is not None and disabled is not None and not callable(active) and not callable(disabled):
            return repr((list(active), bool(disabled)))
    return ""


def weights_state(model) -> tuple:
    """A cheap token of the model's *current* weights in this process (no checksum: storage, version, adapters).

    Equal tokens mean nothing was written since; :func:`tag_producer` stamps it on the caches a model returns, so a
    donor that this model made with its present weights is recognised without a probe."""
    target = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    return (tuple((p.data_ptr(), _version(p)) for p in target.parameters()), _adapter_state(target))


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
