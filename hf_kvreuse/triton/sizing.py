"""What the Triton launchers size their tiles by: the target GPU's shared memory per block, and whether Triton's
CPU interpreter runs the kernel.

Shared memory: the opt-in maximum per block (``cudaDevAttrMaxSharedMemoryPerBlockOptin``, what Triton checks a
compiled kernel against before launching it: a kernel over it raises ``OutOfResources``), read from the CUDA device.
:func:`assume_target` sizes launches for a GPU that is not there: the ahead-of-time compile check
(:mod:`hf_kvreuse.triton.compile_check`) runs the launchers on CPU tensors for sm_80 and sm_90 this way. Off CUDA
(the interpreter) launches are sized as for an A100.

The interpreter: Triton's interpreter multiplies bfloat16 / float16 ``tl.dot`` operands wrongly (triton 3.9), so
the attention kernels widen their tiles to float32 while it runs. Whether it runs is a property of the kernel
object (``triton.jit`` returns an ``InterpretedFunction`` when ``TRITON_INTERPRET=1`` at decoration), not of where
the tensors live: CPU tensors never reach a compiled kernel, but CUDA tensors do reach the interpreter.

Nothing here imports triton at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import NamedTuple

import torch

#: opt-in shared memory per block (bytes) by compute capability (CUDA programming guide, "Compute Capabilities")
SMEM_OPTIN = {(7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
              (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376}
#: the launch sizing used off CUDA (Triton's interpreter has no limit): an A100's
DEFAULT_CAPABILITY = (8, 0)
#: 32-bit registers per SM, and the most one thread may use (every target from sm_50 to sm_120)
REGISTERS_PER_SM = 65_536
MAX_REGISTERS_PER_THREAD = 255


@dataclass(frozen=True)
class Target:
    """A GPU the launchers size for: compute capability and opt-in shared memory per block (bytes)."""

    capability: tuple[int, int]
    shared_memory: int

    @classmethod
    def of(cls, capability: tuple[int, int]) -> "Target":
        return cls(tuple(capability), SMEM_OPTIN.get(tuple(capability), 101_376))


_ASSUMED: contextvars.ContextVar[Target | None] = contextvars.ContextVar("hf_kvreuse_assumed_target", default=None)


@contextlib.contextmanager
def assume_target(target: Target):
    """Within the block, launches are sized for ``target`` whatever device their tensors are on (the
    ahead-of-time compile check)."""
    token = _ASSUMED.set(target)
    try:
        yield target
    finally:
        _ASSUMED.reset(token)


def target(device: torch.device) -> Target:
    """The target a launch on ``device`` is sized for: :func:`assume_target`'s, the CUDA device's, else an A100."""
    assumed = _ASSUMED.get()
    if assumed is not None:
        return assumed
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cap = (props.major, props.minor)
        smem = getattr(props, "shared_memory_per_block_optin", None) or SMEM_OPTIN.get(cap, 101_376)
        return Target(cap, int(smem))
    return Target.of(DEFAULT_CAPABILITY)


def interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``triton.jit`` result) runs in Triton's CPU interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a triton without the interpreter
        return False
    return isinstance(kernel, InterpretedFunction)


class Tiles(NamedTuple):
    """One attention launch's tiling: query rows and key columns per tile, warps per program, pipelining stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def attention_smem(block_m: int, block_n: int, block_d: int, element_size: int, num_stages: int,
                   block_r: int = 0) -> int:
    """Upper bound of a flash-attention kernel's shared memory (bytes): ``num_stages`` buffered key tiles (K and V,
    plus a ``[N, block_r]`` low-rank tile), Q and a tile of its size for layout conversions, a P tile and its
    ``[M, block_r]`` companion, plus 8 KB. Above every size Triton 3.9 allocated in the compile check for sm_80
    and sm_90 (e.g. 82,432 B on sm_90 for bfloat16, head dim 128, 64 x 64 tiles, 2 stages: estimated 114,688 B)."""
    keys = num_stages * block_n * (2 * block_d + block_r)
    return (keys + 2 * block_m * block_d + block_m * (block_n + block_r)) * element_size + 8192


def attention_tiles(element_size: int, block_d: int, shared_memory: int, rows: int | None = None,
                    block_r: int = 0, block_m: int | None = None, block_n: int | None = None) -> Tiles:
    """The tiling of the flash-attention kernels (selected-row and low-rank attention) for one element size,
    padded head dim (``block_d``) and target shared memory (``rows``: query rows of the launch, when few).

    Registers bind before shared memory: every thread holds its share of the float32 accumulator ``[M, D]``
    and of Q, and with IEEE float32 (no tensor cores: ``tl.dot`` on FMAs) of the operand tiles too. The sizes
    below keep that share at 16-32 values (half precision ``M x D <= 8192`` over 4-8 warps; float32 16-32 rows)
    and are the largest that compiled without a register spill for both sm_80 and sm_90 in the compile check's
    sweep (64 x 64 with 4 warps spilled from head dim 128 on, float32 at 64 x 32). The low-rank kernel's
    extra ``[M, r]`` accumulator and ``[N, r]`` tile (``block_r``) halve the key tiles, and the rows too past
    ``D + r = 144`` (bfloat16, head dim 128, rank 64: 64 x 64 spilled 784 B, 32 x 64 none). Few query rows
    (decode) take 16-row tiles. Then the pipelining depth: 2 stages where :func:`attention_smem` fits the target, else
    1, else narrower key tiles, then fewer rows (GPUs with ~100 KB per block: sm_86, sm_89, sm_120). An
    explicit ``block_m`` / ``block_n`` keeps the rest of the rule."""
    if element_size == 4:
        bm, bn, warps = (32, 32, 4) if block_d <= 64 else (16, 32, 4) if block_d <= 128 else (16, 32, 8)
    else:
        bm, bn, warps = (64, 64, 4) if block_d <= 64 else (64, 64, 8) if block_d <= 128 else (32, 64, 8)
    if block_r:  # low-rank attention also holds an [M, r] accumulator and an [N, r] tile: narrower tiles
        bn = max(16, bn // 2)
        if block_d + block_r > 144:
            bm = max(16, bm // 2)
    if rows is not None:
        bm = min(bm, max(16, 1 << max(rows - 1, 0).bit_length()))
    bm, bn = block_m or bm, block_n or bn
    while True:
        for stages in (2, 1):
            if attention_smem(bm, bn, block_d, element_size, stages, block_r) <= shared_memory:
                return Tiles(bm, bn, warps, stages)
        if bn > 16 and block_n is None:
            bn //= 2
        elif bm > 16 and block_m is None:
            bm //= 2
        else:  # the smallest tiles; the compile check (or Triton at launch) reports what still does not fit
            return Tiles(bm, bn, warps, 1)
