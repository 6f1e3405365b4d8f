"""Token ids from whatever a user holds: a tensor, a list, or what a tokenizer / ``apply_chat_template`` returns.

On transformers 5, ``tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")`` and
``tok(text, return_tensors="pt")`` return a ``BatchEncoding`` (a mapping with ``input_ids`` and
``attention_mask``); on 4.x ``apply_chat_template`` returns the ids tensor itself. Every place that takes prompt ids
(the caches' ``input_ids=`` / ``donor_ids=``, :meth:`hf_kvreuse.ReuseSession.generate`, ``model.generate(enc,
cache=...)``) converts through :func:`prompt_ids`, so all of them accept the same things and refuse the same
things with the same words: a batch of several prompts, padding (an attention mask with zeros), text instead of
ids.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["prompt_ids", "split_encoding", "inferred_padding", "refuse_inferred_padding"]

_HOW = ("pass token ids: a LongTensor [1, T], a list of ints, or what the tokenizer returns "
        "(tok(text, return_tensors='pt') or tok.apply_chat_template(msgs, add_generation_prompt=True, "
        "return_tensors='pt'))")


def split_encoding(x, name: str = "input_ids") -> tuple[object, torch.Tensor | None]:
    """``(ids, attention_mask)`` of ``x``: a mapping's ``input_ids`` and ``attention_mask`` (None if absent), or
    ``(x, None)`` for anything else. A mapping without ``input_ids`` is refused with what to pass."""
    if isinstance(x, Mapping) or (hasattr(x, "keys") and hasattr(x, "__getitem__") and not isinstance(x, torch.Tensor)):
        keys = list(x.keys())
        if "input_ids" not in keys:
            raise TypeError(f"{name}: got a mapping with keys {keys} and no 'input_ids'; {_HOW}")
        return x["input_ids"], (x["attention_mask"] if "attention_mask" in keys else None)
    return x, None


def prompt_ids(x, name: str = "input_ids", mask=None) -> torch.Tensor:
    """``x`` as one prompt's ids, a ``[1, T]`` LongTensor (on the device ``x`` was on).

    Parameters
    ----------
    x : LongTensor ``[T]`` or ``[1, T]``, list of ints, or a mapping with ``input_ids`` (and ``attention_mask``)
        E.g. a ``BatchEncoding`` from a tokenizer or ``apply_chat_template``.
    name : str
        The argument's name, for the error messages.
    mask : tensor, optional
        An attention mask given beside ``x`` (e.g. ``generate``'s ``attention_mask=``); checked like a mapping's.

    Raises
    ------
    TypeError
        Text, or a mapping without ``input_ids``.
    ValueError
        Several prompts (a batch), or an attention mask with zeros (padding): hf_kvreuse serves one unpadded
        prompt per call.
    """
    ids, enc_mask = split_encoding(x, name)
    if isinstance(ids, str) or (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], str)):
        raise TypeError(f"{name}: got text; {_HOW}")
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids, dtype=torch.long)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name}: cannot read token ids from {type(ids).__name__} ({e}); {_HOW}") from None
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name}: token ids must be integers, got dtype {ids.dtype}")
    ids = ids.long()
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{name} must be one sequence ([1, T]); batched or padded inputs are not supported "
                         f"yet (got shape {tuple(ids.shape)}): pass one prompt per call")
    for m in (enc_mask, mask):
        if m is None:
            continue
        m = torch.as_tensor(m)
        if m.dim() == 1:
            m = m[None]
        if tuple(m.shape) != tuple(ids.shape):
            raise ValueError(f"{name}: attention_mask of shape {tuple(m.shape)} does not match the ids "
                             f"{tuple(ids.shape)}")
        if not bool(m.bool().all()):
            raise ValueError(f"{name}: the attention_mask has zeros (padding); padded prompts are not supported: "
                             "pass one unpadded prompt (tok(text, return_tensors='pt') without padding=True)")
    return ids


def inferred_padding(model, ids: torch.Tensor, generate_kwargs: dict) -> tuple[int, torch.Tensor] | None:
    """``(pad_id, mask)`` where ``model.generate(ids, **generate_kwargs)`` would infer an attention mask with zeros
    from a pad id inside the prompt, else None.

    Without an ``attention_mask``, transformers' ``generate`` resolves the pad id (the call's ``pad_token_id``, else
    the generation config's, else the first eos id) and, when the prompt holds it and it is not an eos id, masks
    those tokens as padding (and shifts the positions after them). A cache or session that reads the prompt as text
    would then answer differently, so every place that takes prompt ids asks this function first.
    """
    if generate_kwargs.get("attention_mask") is not None:
        return None
    from .generation.options import call_options

    cfg = call_options(model, generate_kwargs).config
    eos = getattr(cfg, "eos_token_id", None)
    eos = [] if eos is None else [int(e) for e in torch.as_tensor(eos).reshape(-1).tolist()]
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else None  # generate's own fallback: then pad is an eos id and nothing is inferred
    if pad is None:
        return None
    pad = int(torch.as_tensor(pad).reshape(-1)[0])
    if pad in eos:
        return None
    mask = ids.ne(pad).long()
    if bool(mask.all()):
        return None
    return pad, mask


def refuse_inferred_padding(model, ids: torch.Tensor, generate_kwargs: dict, who: str) -> None:
    """Raise a ``ValueError`` naming the pad id where ``generate`` would mask pad tokens of the prompt (see
    :func:`inferred_padding`) and ``who`` (a cache or a session policy) would read them as text instead."""
    found = inferred_padding(model, ids, generate_kwargs)
    if found is None:
        return
    pad, mask = found
    at = (mask[0] == 0).nonzero().flatten().tolist()
    raise ValueError(f"the prompt holds the pad token id {pad} (at position{'s' if len(at) > 1 else ''} "
                     f"{', '.join(map(str, at[:8]))}{', ...' if len(at) > 8 else ''}) and no attention_mask was "
                     f"given: plain generate would mask it as padding, which {who} does not reproduce. Pass "
                     "attention_mask=torch.ones_like(input_ids) if the token is meant as text (or, with "
                     "ReuseSession, use policy 'auto' or 'full', which then run plain generate)")


def unpack_generate_inputs(kwargs: dict) -> None:
    """``model.generate(enc, cache=...)`` with a tokenizer's mapping as the prompt: its ``input_ids`` and
    ``attention_mask`` become the keywords ``generate`` expects (as ``model.generate(**enc, ...)`` passes them), in
    place. Anything else is left as it is."""
    inputs = kwargs.get("inputs")
    if inputs is None or isinstance(inputs, torch.Tensor):
        return
    ids, mask = split_encoding(inputs, "inputs")
    if ids is inputs:
        return
    if kwargs.get("input_ids") is not None:
        raise ValueError("generate() got the prompt twice: a mapping as inputs and input_ids=")
    kwargs.pop("inputs")
    kwargs["input_ids"] = ids
    if mask is not None:
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"] is not mask:
            raise ValueError("generate() got two attention masks: the mapping's and attention_mask=")
        kwargs["attention_mask"] = mask
