"""Every Triton kernel, launched as the library launches it, compiled ahead of time for sm_80 (A100) and sm_90
(H100 / H200) with Triton's bundled ptxas, no GPU needed; each launch's shared memory, registers and spills
checked against the target's limits (:mod:`hf_kvreuse.triton.compile_check`).

The compiler cannot run in this process (``tests/conftest.py`` turns Triton's interpreter on before triton is
imported), so one subprocess per group compiles its cases (two processes in parallel); results are cached per
Triton cache key under ``~/.triton/cache`` (``TRITON_CACHE_DIR``), so reruns on an unchanged tree take seconds.
The representative subset (each kernel at its heaviest shapes) runs in the fast suite; every other dtype, head dim,
GQA ratio, mask, rank and split variant is marked ``slow``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from hf_kvreuse.triton import compile_check as cc  # noqa: E402
from hf_kvreuse.triton import sizing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAST = cc.cases(full=False)
REST = [c for c in cc.cases(full=True) if not c.fast]
TARGETS = list(cc.TARGETS)


def _compile(cases: list) -> dict:
    """Compile ``cases`` for every target in a subprocess without the interpreter: {(case, target): [results]}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "hf_kvreuse.triton.compile_check", "--json", "-", "--only",
                           *(c.name for c in cases)], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode not in (0, 1):  # 1: some launch does not fit (reported per case below)
        raise RuntimeError(f"compile check failed to run:\n{proc.stderr[-4000:]}")
    results: dict = {}
    for r in json.loads(proc.stdout)["results"]:
        results.setdefault((r["case"], r["target"]), []).append(r)
    return results


@pytest.fixture(scope="module")
def fast_results():
    return _compile(FAST)


@pytest.fixture(scope="module")
def rest_results():
    return _compile(REST)


def _fits(results: dict, case, target: str) -> None:
    """Every launch of ``case`` fits ``target``; an attention launch also needs no more shared memory than
    :func:`sizing.attention_smem` estimates (the bound that sizes launches for GPUs the check does not compile for)."""
    got = results.get((case.name, target))
    assert got, f"{case.name} was not compiled for {target}"
    bad = [f"{r['kernel']} ({r['constexprs']}, {r['num_warps']} warps, {r['num_stages']} stages): "
           f"{'; '.join(r['problems'])}" for r in got if not r["ok"]]
    assert not bad, f"{case.name} on {target}: " + " | ".join(bad)
    for r in got:
        c = r["constexprs"]
        if r["kernel"] in ("selected_attention_kernel", "lowrank_attention_kernel"):
            est = sizing.attention_smem(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_D"], cc.DTYPES[case.dtype].itemsize,
                                        r["num_stages"], c.get("BLOCK_R", 0))
            assert r["shared"] <= est, f"{r['kernel']}: {r['shared']:,} B > the estimate {est:,} B"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", FAST, ids=lambda c: c.name)
def test_kernel_fits_the_target(fast_results, case, target):
    """Each kernel at its heaviest shapes compiles for the target within its shared memory and register file,
    spilling at most ``SPILL_LIMIT`` (64) bytes per thread.

    Planted bug that fails it (real, not planted: the code before issue 22): fixed 64 x 64 tiles with Triton's
    default 3 stages in ``selected_attention_triton``: float32 at head dim 128 needs 181,504 B of shared memory on
    sm_80 (limit 166,912 B) and float32 at head dim 256 345,344 B on sm_90 (limit 232,448 B), both spilling
    tens of KB per thread; bfloat16 at head dim 256 needs 214,016 B on sm_80 and 263,168 B on sm_90."""
    _fits(fast_results, case, target)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", REST, ids=lambda c: c.name)
def test_every_shape_fits_the_target(rest_results, case, target):
    """The rest of the matrix: fp32 / bf16 at head dims 64, 80, 96, 128, 256 and fp16 at 256, GQA 1 with a
    ``k_valid`` mask, low-rank prefill and split-K decode (with its merge kernel), ranks 8 and 64, and the
    element-wise kernels at head dims 80 and 256.

    Planted bug that fails it: the low-rank epilogue always a ``tl.dot`` on the ``[r, D]`` float32 tile of B (no
    column loop): rank 64 at head dim 256 spills 268 B per thread on sm_80, 248 B on sm_90. (The code before
    issue 22 fails it too: e.g. low-rank bf16 prefill at head dim 128 spilled 29-38 KB per thread.)"""
    _fits(rest_results, case, target)


def test_limits_flag_what_failed_before_issue_22():
    """The limits themselves, on the figures the compile check measured for the code before issue 22 (no compile).

    Planted bug that fails it: ``check_limits`` compares the shared memory with the 48 KB static limit, not the
    opt-in maximum (the sized launch below would be refused)."""
    old = cc.Result("selected_attention[gqa4,fp32,d128]", "sm_80", "selected_attention_kernel", {}, 4, 3,
                    shared=181_504, registers=32, spill_stores=29_432, spill_loads=55_436)
    problems = cc.check_limits(old, cc.TARGETS["sm_80"])
    assert len(problems) == 2 and "181,504 B > 166,912 B" in problems[0] and "spills" in problems[1]
    new = cc.Result("selected_attention[gqa4,fp32,d128]", "sm_80", "selected_attention_kernel", {}, 4, 2,
                    shared=43_264, registers=96, spill_stores=0, spill_loads=0)
    assert cc.check_limits(new, cc.TARGETS["sm_80"]) == []
    assert cc.check_limits(cc.Result("x", "sm_90", "k", {}, 8, 2, shared=232_448, registers=255, spill_stores=0,
                                     spill_loads=0), cc.TARGETS["sm_90"]) == []  # 255 x 256 threads fits 65,536
    crowded = cc.Result("x", "sm_90", "k", {}, 16, 2, shared=0, registers=255, spill_stores=0, spill_loads=0)
    assert "registers" in cc.check_limits(crowded, cc.TARGETS["sm_90"])[0]
