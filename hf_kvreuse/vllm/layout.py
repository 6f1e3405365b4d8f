"""vLLM's paged K/V layout, read and written token by token, after checking it with vLLM's own write kernel.

A vLLM attention layer keeps its K/V in one tensor of blocks. The CPU backend of vLLM 0.32 (``CPU_ATTN``) shapes
it ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, but what lies inside a block depends on the kernel set
(ISA) it picked: with the ``vec`` kernels each (block, head) holds the keys **transposed**, ``K^T [head_dim,
block_size]``, then the values ``V [block_size, head_dim]`` (the "kt_v" layout below). Read row by row as tokens,
those keys are wrong; whole-block copies hide the difference, per-token copies and RoPE re-rotation do not.

So nothing here assumes a layout: :func:`detect_layout` writes known keys and values into a scratch tensor with
the engine's own write kernel (``cpu_attn_reshape_and_cache``, the op the attention layer calls), and accepts a
layout only if reading them back through it returns them exactly. A kernel that writes them any other way is
refused with :class:`UnknownLayoutError`, naming the shape, dtype and ISA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import HFKVReuseError


class UnknownLayoutError(HFKVReuseError, RuntimeError):
    """The engine stores K/V in a paged layout this connector does not know (or cannot verify)."""


@dataclass(frozen=True)
class PagedLayout:
    """One paged layout of a ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` layer tensor.

    Parameters
    ----------
    name : {"kt_v", "k_v"}
        ``"kt_v"``: per (block, head) ``K^T [head_dim, block_size]`` then ``V [block_size, head_dim]`` (vLLM CPU,
        ``vec`` kernels); ``"k_v"``: ``K [block_size, head_dim]`` then ``V [block_size, head_dim]``.
    block_size, kv_heads, head_dim : int
    """

    name: str
    block_size: int
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.name not in LAYOUTS:
            raise UnknownLayoutError(f"paged layout {self.name!r}: known layouts are {sorted(LAYOUTS)}")

    def check(self, layer: torch.Tensor, what: str = "layer") -> None:
        """Refuse a layer tensor whose shape is not this layout's."""
        want = (self.kv_heads, self.block_size, 2 * self.head_dim)
        if layer.dim() != 4 or tuple(layer.shape[1:]) != want or not layer.is_contiguous():
            raise UnknownLayoutError(f"{what}: paged K/V tensor {tuple(layer.shape)} (contiguous="
                                     f"{layer.is_contiguous()}) is not [num_blocks, {want[0]}, {want[1]}, {want[2]}] "
                                     f"as the {self.name!r} layout this connector checked")

    def _halves(self, layer: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one block: keys ``[H, B, D]`` (possibly a transposed view) and values ``[H, B, D]``."""
        B, D, H = self.block_size, self.head_dim, self.kv_heads
        flat = layer[block].view(H, 2 * B * D)
        if self.name == "kt_v":
            k = flat[:, :B * D].view(H, D, B).transpose(1, 2)
        else:
            k = flat[:, :B * D].view(H, B, D)
        return k, flat[:, B * D:].view(H, B, D)

    def read(self, layer: torch.Tensor, block_ids: Sequence[int], start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``start..end`` of a request whose blocks are ``block_ids``: ``(k, v)``, each ``[H, end-start, D]``."""
        ks, vs = [], []
        B = self.block_size
        for b in range(start // B, (end - 1) // B + 1):
            lo, hi = max(start, b * B) - b * B, min(end, (b + 1) * B) - b * B
            k, v = self._halves(layer, int(block_ids[b]))
            ks.append(k[:, lo:hi])
            vs.append(v[:, lo:hi])
        return torch.cat(ks, 1), torch.cat(vs, 1)

    def write(self, layer: torch.Tensor, block_ids: Sequence[int], start: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write ``k``, ``v`` (``[H, n, D]``) as tokens ``start..start+n`` of a request whose blocks are ``block_ids``."""
        n, B = k.shape[1], self.block_size
        end = start + n
        for b in range(start // B, (end - 1) // B + 1):
            lo, hi = max(start, b * B), min(end, (b + 1) * B)
            dk, dv = self._halves(layer, int(block_ids[b]))
            dk[:, lo - b * B:hi - b * B].copy_(k[:, lo - start:hi - start])
            dv[:, lo - b * B:hi - b * B].copy_(v[:, lo - start:hi - start])


LAYOUTS = ("kt_v", "k_v")

#: write_kernel(key [T, H, D], value [T, H, D], layer [num_blocks, H, B, 2D], slots [T]) writes tokens to slots
WriteKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def detect_layout(write_kernel: WriteKernel, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                  what: str = "the engine") -> PagedLayout:
    """The layout in which ``write_kernel`` stores K/V, found by writing distinct values and reading them back.

    Two blocks are written, starting mid-block (slots ``3..3 + block_size + 5``), with every element distinct, and
    the rest of the scratch tensor must stay zero. Raises :class:`UnknownLayoutError` when no known layout
    returns exactly what was written.
    """
    H, B, D = kv_heads, block_size, head_dim
    scratch = torch.zeros(3, H, B, 2 * D, dtype=dtype)
    n = B + 5
    # distinct, exactly representable values (bf16 holds integers up to 256 exactly, with a sign)
    base = torch.arange(n * H * D, dtype=torch.float32).reshape(n, H, D)
    key = ((base % 251) + 1).to(dtype)
    value = -((base * 7 % 241) + 1).to(dtype)
    slots = torch.arange(3, 3 + n, dtype=torch.long)
    try:
        write_kernel(key, value, scratch, slots)
    except Exception as e:  # noqa: BLE001
        raise UnknownLayoutError(f"{what}: its K/V write kernel failed on a [{H} heads, block {B}, head_dim {D}, "
                                 f"{dtype}] probe ({type(e).__name__}: {e}); the paged layout cannot be verified") from e
    block_ids = [0, 1, 2]
    written = int((scratch != 0).sum())
    for name in LAYOUTS:
        layout = PagedLayout(name, B, H, D)
        k, v = layout.read(scratch, block_ids, 3, 3 + n)
        if written == 2 * n * H * D and torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1)):
            return layout
    raise UnknownLayoutError(f"{what}: K/V written by the engine's own kernel ({H} heads, block {B}, head_dim {D}, "
                             f"{dtype}) match none of the paged layouts this connector knows ({', '.join(LAYOUTS)}); "
                             "refusing to read or write its blocks token by token")
