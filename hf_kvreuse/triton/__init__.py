"""Triton kernels, each with a torch reference (none yet: the eager torch paths are the references)."""
