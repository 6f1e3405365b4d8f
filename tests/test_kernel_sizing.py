"""How the attention launchers size and configure a launch, checked on the recorded launch (no kernel runs): the
interpreter's bfloat16 workaround follows the interpreter, tiles follow the target's shared memory."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from hf_kvreuse.triton import lowrank_attention as la  # noqa: E402
from hf_kvreuse.triton import selected_attention as sa  # noqa: E402
from hf_kvreuse.triton import sizing  # noqa: E402


class _Compiled:
    """A compiled kernel's stand-in: records the launch's keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


class _Interpreted(InterpretedFunction):
    """What ``triton.jit`` returns under ``TRITON_INTERPRET=1``, recording instead of interpreting."""

    def __init__(self):
        self.launches = []

    def run(self, *args, grid, warmup, **kwargs):
        self.launches.append(kwargs)


def _launch(monkeypatch, which: str, kernel, dtype=torch.bfloat16, D=64):
    """Run ``which`` launcher on small CPU tensors with ``kernel`` standing in for its jitted kernel."""
    if which == "selected":
        monkeypatch.setattr(sa, "_kernel", lambda: (triton, kernel))
        q = torch.zeros(1, 4, 5, D, dtype=dtype)
        k = torch.zeros(1, 2, 9, D, dtype=dtype)
        sa.selected_attention_triton(q, k, k, torch.arange(4, 9), torch.arange(9), 0.1)
    else:
        monkeypatch.setattr(la, "_kernels", lambda: (triton, kernel, kernel))
        q = torch.zeros(1, 4, 5, D, dtype=dtype)
        k = torch.zeros(1, 2, 9, D, dtype=dtype)
        la.lowrank_attention_triton(q, k, k, torch.zeros(1, 9, 8, dtype=dtype), torch.zeros(1, 2 * D, 8, dtype=dtype),
                                    torch.zeros(1, dtype=dtype), None, 0.1)
    return kernel.launches[-1]


@pytest.mark.parametrize("which", ["selected", "lowrank"])
def test_interpreter_workaround_follows_the_interpreter(monkeypatch, which):
    """The float32 widening of half-precision ``tl.dot`` tiles (the interpreter's bfloat16 dot is wrong) is on
    exactly when the kernel runs in Triton's interpreter, whatever the tensors' device: on for an interpreted
    kernel (also with CUDA tensors: a CPU/GPU split model under ``TRITON_INTERPRET=1``, where the device-keyed rule
    returned garbage), off for a compiled one (CPU tensors here stand in for any device).

    Planted bug that fails it: the launcher keys the workaround on the device (``UPCAST = dev.type == "cpu"`` in
    ``selected_attention_triton``, ``upcast = value.device.type != "cuda"`` in ``lowrank_attention_triton``: the
    code before issue 22), which turns it on for the compiled kernel here."""
    assert _launch(monkeypatch, which, _Interpreted())["UPCAST"] is True
    assert _launch(monkeypatch, which, _Compiled())["UPCAST"] is False
    assert _launch(monkeypatch, which, _Compiled(), dtype=torch.float32)["UPCAST"] is False


@pytest.mark.parametrize("which", ["selected", "lowrank"])
@pytest.mark.parametrize("element_size,dtype", [(4, torch.float32), (2, torch.bfloat16)])
@pytest.mark.parametrize("D", [64, 80, 128, 256])
def test_launch_tiles_follow_the_targets_shared_memory(monkeypatch, which, element_size, dtype, D):
    """Under :func:`sizing.assume_target` the launch is sized for that GPU: its shared-memory estimate fits the
    target, and a target with less shared memory never gets larger tiles or more stages.

    Planted bug that fails it: the launcher ignores the target (fixed 64 x 64 tiles, 3 stages: the code before
    issue 22, whose estimate exceeds sm_80's 166,912 B for float32 at head dim 128)."""
    seen = []
    for cap in [(9, 0), (8, 0), (8, 9)]:
        target = sizing.Target.of(cap)
        with sizing.assume_target(target):
            kw = _launch(monkeypatch, which, _Compiled(), dtype=dtype, D=D)
        est = sizing.attention_smem(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_D"], element_size, kw["num_stages"],
                                    kw.get("BLOCK_R", 0))
        assert est <= target.shared_memory, (cap, kw)
        seen.append((kw["BLOCK_M"] * kw["BLOCK_N"], kw["num_stages"]))
    assert seen == sorted(seen, reverse=True)


def test_target_of_a_device_and_an_assumed_one():
    """Off CUDA launches are sized for an A100; :func:`sizing.assume_target` overrides any device, and the override
    ends with its block.

    Planted bug that fails it: ``assume_target`` does not reset its context variable."""
    cpu = torch.device("cpu")
    assert sizing.target(cpu) == sizing.Target((8, 0), 166_912)
    with sizing.assume_target(sizing.Target.of((9, 0))):
        assert sizing.target(cpu).shared_memory == 232_448
    assert sizing.target(cpu).shared_memory == 166_912
