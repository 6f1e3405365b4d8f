"""Benchmark cases of benchmarks/triton_kernels.py, one module per kernel.

Each module defines ``CASES``: a list of :class:`Case`. ``make(device, dtype, tokens)`` builds the inputs at a
realistic size (``tokens`` cached tokens; 32 layers x 8 KV heads x 128 dims unless the kernel says otherwise) and
returns a :class:`Prepared`: two zero-argument callables (the eager torch reference and the Triton kernel, each
doing the whole operation once), the bytes the operation must move at least (read + written, for the achieved
bandwidth) and whether the kernel is memory-bound (the ≥ 60 %-of-peak target applies only then).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Prepared:
    torch_fn: Callable[[], object]
    triton_fn: Callable[[], object]
    bytes_moved: int
    memory_bound: bool = True
    check: Callable[[], float] | None = None  # max abs difference triton vs torch (optional)


@dataclass
class Case:
    name: str
    make: Callable[[torch.device, torch.dtype, int], Prepared]


def all_cases() -> list[Case]:
    cases = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        cases += importlib.import_module(f"{__name__}.{info.name}").CASES
    return cases
