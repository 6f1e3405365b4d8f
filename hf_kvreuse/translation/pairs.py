"""Ready pairs: the offline Qwen2.5-Coder-0.5B-Instruct -> 1.5B-Instruct map, fitted once by one command.

``python -m hf_kvreuse.translation fit`` (or :func:`qwen_pair_mapper`) loads both models from the offline kit,
builds the calibration set from **DROP** passages and questions (Wikipedia text in the same chat QA format as
the evaluation, but another dataset: the SQuAD evaluation items are never seen), fits the map with a tqdm bar and
saves it (safetensors + JSON) under ``$HF_KVREUSE_CACHE/maps/``. Later calls load it and check the pair.
``prompts=`` (CLI ``--prompts FILE.jsonl``) calibrates on the user's own prompts instead: on this pair, prompts of
the task's own domain (other SQuAD articles) gave the best held-out attention-output cosine measured (research notes, TranslatedCache).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..models.offline import cache_dir
from .mapper import KVMapper

QWEN_PAIR = "qwen2.5-coder-0.5b-to-1.5b"
DEFAULT_INPUTS = "kv"  # the kind qwen_pair_mapper() loads or fits: it needs only a source cache (model switch)
# the kind `python -m hf_kvreuse.translation fit` makes by default: the best measured on held-out SQuAD prompts
# (research notes, TranslatedCache: attention-output cosine 0.847 vs 0.830 for "kv" on the same
# calibration rows, R² K 0.77 / V 0.60 vs 0.74 / 0.53); TranslatedCache then needs the source's hidden states
FIT_DEFAULT_INPUTS = "kv+hidden"
# relative ridge penalty per kind, as measured best in those ablations (the hidden kinds overfit at 0.01: held-out
# R² V of "hidden" 0.39 at 0.01 and 0.57 at 0.3 on 4,974 rows; 0.60 at 0.3 and 0.54 at 3.0 on 7,461 rows)
DEFAULT_RIDGE = {"kv": 0.01, "kv-both": 0.01, "hidden": 0.3, "kv+hidden": 0.3}


def calibration_ids(tokenizer, n: int = 64, max_tokens: int = 512, offset: int = 0) -> list[torch.Tensor]:
    """``n`` calibration prompts: DROP passage + question in the chat QA format, at most ``max_tokens`` tokens."""
    from ..workflows.datasets import drop, qa_chat_ids

    items = drop()
    seen, out = set(), []
    for it in items[offset:]:
        if it.passage in seen:
            continue
        seen.add(it.passage)
        ids, _ = qa_chat_ids(tokenizer, it.passage, it.question)
        out.append(torch.tensor(ids[:max_tokens]))
        if len(out) == n:
            break
    return out


def default_map_path(name: str = QWEN_PAIR, inputs: str = "kv") -> Path:
    """Where a map of kind ``inputs`` is kept (the K->K / V->V kind under the original name)."""
    return cache_dir() / "maps" / (name if inputs == "kv" else f"{name}-{inputs}")


def _calibration_prompt(ids, max_tokens: int, where: str) -> torch.Tensor:
    """One calibration prompt as a 1-D LongTensor cut to ``max_tokens``; refused when too short to fit anything."""
    t = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids).reshape(-1)[:max_tokens]
    if t.numel() < 8:
        raise ValueError(f"{where}: {t.numel()} tokens; a calibration prompt needs at least 8 "
                         "(the first 4 positions, attention sinks, are never fitted)")
    return t


def prompts_file_ids(tokenizer, path: str | os.PathLike, n: int | None = None,
                     max_tokens: int = 512) -> list[torch.Tensor]:
    """Calibration prompts from a JSON Lines file, one object per line: ``{"text": str}`` (tokenised as it is, no
    special tokens added) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the tokenizer's chat template
    with the generation prompt, the form a chat prompt takes when its cache is translated). Each prompt is cut to
    ``max_tokens``; ``n`` keeps the first ``n``. Blank lines are skipped; anything else is refused with its line
    number."""
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration prompts: no file at {path}")
    out = []
    with path.open(encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {no}: not JSON ({e.msg})") from None
            if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                ids = tokenizer(obj["text"], add_special_tokens=False)["input_ids"]
            elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                ids = tokenizer.apply_chat_template(obj["messages"], add_generation_prompt=True, tokenize=True)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
            else:
                raise ValueError(f'{path}, line {no}: expected an object with a "text" string or a "messages" list')
            out.append(_calibration_prompt(ids, max_tokens, f"{path}, line {no}"))
            if n is not None and len(out) == n:
                break
    if not out:
        raise ValueError(f"calibration prompts: {path} holds none")
    return out


def qwen_pair_mapper(source=None, target=None, tokenizer=None, path: str | os.PathLike | None = None,
                     n_calibration: int | None = None, max_tokens: int = 512, stride: int = 2, refit: bool = False,
                     progress: bool = True, inputs: str = DEFAULT_INPUTS, hidden_band: int = 1,
                     ridge_lambda: float | None = None, dtype: torch.dtype = torch.bfloat16,
                     prompts: str | os.PathLike | list[torch.Tensor] | None = None) -> KVMapper:
    """The Qwen2.5-Coder 0.5B -> 1.5B map: loaded from ``path`` (default under the cache folder) or fitted there.

    Models not given are loaded in ``dtype`` (default bfloat16) from the offline kit; a map fitted in one dtype is
    valid in the other (the pair's identity rounds the weights to bfloat16). On a CPU without native bf16 float32
    fits several times faster. The map is checked against the models given.
    ``ridge_lambda=None`` takes the measured default of the kind (:data:`DEFAULT_RIDGE`).
    ``prompts``: calibrate on these (a JSON Lines file, see :func:`prompts_file_ids`, or token id tensors) instead
    of DROP. ``n_calibration``: how many prompts (default: 64 of DROP, every one of ``prompts``). A map already
    saved at ``path`` is not refitted on ``prompts`` unless ``refit=True`` (refused otherwise, so that a fit on new
    prompts is never silently skipped).
    """
    from ..models import load_qwen

    if n_calibration is not None and n_calibration < 1:
        raise ValueError(f"n_calibration={n_calibration}: at least one calibration prompt is needed")
    path = Path(path) if path is not None else default_map_path(inputs=inputs)
    if source is None:
        source, tokenizer = load_qwen("0.5b", dtype=dtype)
    if target is None:
        target, tokenizer = load_qwen("1.5b", dtype=dtype)
    if (path / "mapper.json").exists() and not refit:
        if prompts is not None:
            raise ValueError(f"a map is already saved at {path}: pass refit=True (CLI --refit) to fit it again on the "
                             "prompts given, or another path")
        mapper = KVMapper.load(path, source, target)
        if mapper.kind != inputs:
            raise ValueError(f"the map at {path} is of kind {mapper.kind!r}, not {inputs!r}: pass refit=True or "
                             "another path")
        return mapper
    if tokenizer is None:
        from transformers import AutoTokenizer

        from ..models import model_path

        tokenizer = AutoTokenizer.from_pretrained(model_path("0.5b"))
    if prompts is None:
        calib = calibration_ids(tokenizer, 64 if n_calibration is None else n_calibration, max_tokens)
        what = "DROP dev passages+questions, chat QA format"
    elif isinstance(prompts, (str, os.PathLike)):
        calib = prompts_file_ids(tokenizer, prompts, n_calibration, max_tokens)
        what = f"prompts of {Path(prompts).name}"
    else:
        calib = [_calibration_prompt(t, max_tokens, f"prompt {i}") for i, t in enumerate(list(prompts)[:n_calibration])]
        what = "prompts given"
    lam = DEFAULT_RIDGE[inputs] if ridge_lambda is None else ridge_lambda
    mapper = KVMapper.fit(source, target, calib, stride=stride, progress=progress, inputs=inputs,
                          hidden_band=hidden_band, ridge_lambda=lam,
                          description=f"{what}: {len(calib)} prompts <= {max_tokens} tokens, stride {stride}")
    mapper.save(path)
    return mapper
