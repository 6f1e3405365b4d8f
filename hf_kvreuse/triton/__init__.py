"""Triton kernels, each with its torch reference in the same module (the CPU fallback and the tests' oracle).

``rope_rebase``: re-rotation of cached post-RoPE keys by per-token position deltas. ``gather_scatter``: row gather
and row scatter of K/V along the token axis (K and V in one launch). ``deviation``: CacheBlend's per-token squared
K/V deviation and its top-k selection. Dispatch: :mod:`hf_kvreuse.kernels`. Nothing here imports triton at import
time.
"""
