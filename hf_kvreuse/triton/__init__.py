"""Triton kernels, each with its torch reference in the same module (the CPU fallback and the tests' oracle).

``rope_rebase``: re-rotation of cached post-RoPE keys by per-token position deltas. Dispatch:
:mod:`hf_kvreuse.kernels`. Nothing here imports triton at import time.
"""
