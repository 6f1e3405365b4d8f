"""Triton kernels, each with its torch reference in the same module (the CPU fallback and the tests' oracle).

``rope_rebase``: re-rotation of cached post-RoPE keys by per-token position deltas. ``gather_scatter``: row gather
and row scatter of K/V along the token axis (K and V in one launch). ``deviation``: CacheBlend's per-token squared
K/V deviation and its top-k selection. ``lowrank_attention``: PReCache's low-rank value attention
``P·V_base + s·(P·L)·B`` in one flash-attention pass (BaseLRCache). ``selected_attention``: position-causal attention
for an arbitrary subset of query rows (partial recompute), with a blocked-SDPA formulation for CPUs. Dispatch:
:mod:`hf_kvreuse.kernels`. ``sizing``: the attention kernels' tiles, warps and stages for the target GPU's shared
memory, and whether Triton's interpreter runs. ``compile_check``: every kernel compiled ahead of time for sm_80 /
sm_90 (no GPU needed) and checked against their limits. Nothing here imports triton at import time.
"""
