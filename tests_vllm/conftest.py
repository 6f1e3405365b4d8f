"""tests_vllm: hf_kvreuse.vllm's connector inside a real vLLM engine (vLLM's CPU build; ``make test-vllm``).

Skipped where vLLM is not installed. Settings for a small shared CPU machine: no thread pinning, 1 GiB of KV
cache, one OpenMP thread per engine process.
"""

import os

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
