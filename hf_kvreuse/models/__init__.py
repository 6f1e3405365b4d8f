"""Models: offline real models (SmolLM2-135M-Instruct, the Qwen2.5-Coder 0.5B / 1.5B pair, from PyPI wheels)
and test-model builders (tiny random-init models; :mod:`~hf_kvreuse.models.arch_zoo`, tiny configs of many
architectures).

* :mod:`.loaders`: :func:`load_offline`, :func:`load_by_key`, :func:`load_smollm2`, :func:`load_qwen`, :func:`tiny_model`, ...
* :mod:`.offline`: fetching wheel members into ``$HF_KVREUSE_CACHE`` (default ``~/.cache/hf_kvreuse``), sha256;
* :mod:`.arch_zoo`: the architecture zoo of ``tests/test_architectures.py`` and ``scripts/arch_table.py``.
"""

from .arch_zoo import zoo_config, zoo_configs, zoo_model
from .loaders import (DTYPES, MODEL_KEYS, OFFLINE_MODELS, QWEN_ALIASES, TINY_ARCHS, OfflineModel, load_by_key,
                      load_local, load_offline, load_qwen, load_smollm2,
                      model_path, smollm2_path, tiny_config, tiny_model)
from .offline import cache_dir, check_sha256, fetch_wheel_members, sha256_of

__all__ = ["DTYPES", "MODEL_KEYS", "load_by_key", "load_local",
           "OFFLINE_MODELS", "QWEN_ALIASES", "OfflineModel", "load_offline", "load_qwen", "load_smollm2", "model_path",
           "smollm2_path", "TINY_ARCHS", "tiny_config", "tiny_model", "zoo_config", "zoo_configs", "zoo_model",
           "cache_dir", "check_sha256", "fetch_wheel_members", "sha256_of"]
