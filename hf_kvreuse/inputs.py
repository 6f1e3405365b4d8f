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

__all__ = ["prompt_ids", "split_encoding"]

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
