"""Ahead-of-time compile check: every Triton kernel of :mod:`hf_kvreuse.triton`, as the library launches it,
compiled for real NVIDIA targets on a machine without a GPU, with its shared memory and registers checked
against the target's limits.

Triton compiles for a ``GPUTarget`` without a device (its NVIDIA backend ships ``ptxas``), which is how a kernel's
resources are known before any GPU runs it: Triton raises ``OutOfResources`` at launch when a kernel needs more
shared memory than the device grants one block, and ``ptxas`` spills what does not fit in 255 registers a thread
to local memory. For each case (kernel, dtype, head dim, GQA ratio / rank / mask / split variant) this module

1. runs the library's own launcher on small CPU tensors of that shape under
   :func:`hf_kvreuse.triton.sizing.assume_target` (so the launcher sizes tiles, warps and stages for the target,
   exactly as it would on that GPU), with the jitted kernels swapped for recorders that capture each launch's
   arguments instead of running it;
2. compiles every captured launch with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``,
   specialised from the captured arguments the way ``JITFunction.run`` specialises a real launch (dtypes, integer
   1s, 16-byte alignment and divisibility), and reads ``ptxas``'s report (registers, spill stores / loads);
3. checks: shared memory <= the target's opt-in maximum per block (sm_80: 166,912 B; sm_90: 232,448 B);
   registers x threads <= 65,536 (one block must fit an SM's register file); spills of at most
   :data:`SPILL_LIMIT` bytes per thread.

Identical compilations (head dims 80, 96 and 128 share one padded kernel) are compiled once; results are cached
per Triton cache key under Triton's cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), so a
second run only compiles what changed. Triton's interpreter must be off in this process (``TRITON_INTERPRET``
unset): the test suite runs it in a subprocess (``tests/test_kernel_compile.py``).

    python -m hf_kvreuse.triton.compile_check                   # the representative subset, sm_80 and sm_90
    python -m hf_kvreuse.triton.compile_check --full --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch

from . import sizing

TARGETS = {"sm_80": sizing.Target((8, 0), sizing.SMEM_OPTIN[(8, 0)]),
           "sm_90": sizing.Target((9, 0), sizing.SMEM_OPTIN[(9, 0)])}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 80, 96, 128, 256)
#: spilled bytes per thread tolerated: a few stack slots where ptxas stops near its register cap (8 warps: 128
#: registers per thread in some kernels); float32 launches of earlier kernel versions spilled up to 77 KB per thread
SPILL_LIMIT = 64


@dataclass(frozen=True)
class Case:
    """One shape the library can launch: ``kernel`` (a module of :mod:`hf_kvreuse.triton`), a variant of its
    launcher's arguments, dtype and head dim; ``fast`` marks the representative subset."""

    kernel: str
    variant: str
    dtype: str
    head_dim: int
    fast: bool = False

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.variant},{self.dtype},d{self.head_dim}]"


def cases(full: bool = True) -> list[Case]:
    """Every case (``full``) or the representative subset (``fast``: each kernel at its heaviest shapes, among
    them the two float32 launches that did not fit in earlier kernel versions).

    Head dims 80 and 96 compile to head dim 128's kernel (padded to 128, divisible by 16: the same specialisation),
    so they cost nothing once 128 is compiled; float16 has bfloat16's element size and tiles and is compiled at
    head dim 256 only; GQA 1 with a ``k_valid`` mask at 128; ranks 8 (padded to 16) and 64."""
    fast = {("selected_attention", "gqa4", "fp32", 128), ("selected_attention", "gqa4", "fp32", 256),
            ("selected_attention", "gqa4", "bf16", 256), ("lowrank_attention", "prefill-causal-r8", "bf16", 256),
            ("lowrank_attention", "decode-split-float-r8", "fp32", 256), ("rope_rebase", "half", "bf16", 256),
            ("gather_scatter", "scatter-kv-from-fp32", "fp32", 256), ("deviation", "upcast-norm", "fp32", 256)}
    out = []
    for dt in DTYPES:
        for d in HEAD_DIMS:
            if dt == "fp16" and d != 256:
                continue
            variants = [("selected_attention", "gqa4"), ("lowrank_attention", "prefill-causal-r8"),
                        ("lowrank_attention", "decode-split-float-r8")]
            if d == 128 and dt == "bf16":
                variants.append(("selected_attention", "gqa1-valid"))
            if d == 256 and dt == "bf16":
                variants.append(("lowrank_attention", "prefill-bool-r64"))
            if d in (80, 256) and dt != "fp16":
                variants += [("rope_rebase", "half"), ("gather_scatter", "gather-kv"),
                             ("gather_scatter", "scatter-kv-from-fp32"), ("deviation", "round"),
                             ("deviation", "upcast-norm")]
                if d == 256:
                    variants.append(("rope_rebase", "interleaved-partial"))
            out += [Case(k, v, dt, d, fast=(k, v, dt, d) in fast) for k, v in variants]
    return out if full else [c for c in out if c.fast]


# --------------------------------------------------------------------------------------- the library's launches


def _run_launcher(case: Case) -> None:
    """Call the library's launcher for ``case`` on small CPU tensors (the kernels are recorders meanwhile)."""
    dtype, D = DTYPES[case.dtype], case.head_dim
    z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt)  # noqa: E731  (values never matter)
    if case.kernel == "selected_attention":
        from .selected_attention import selected_attention_triton

        gqa = int(case.variant[3:].split("-")[0])
        Hkv, R, N = 2, 100, 160  # more rows than the largest tile: the launcher's full-size tiles
        q = z(1, R, Hkv * gqa, D).transpose(1, 2)  # the layouts of the engine: q / out views of [B, R, H, D]
        out = z(1, R, Hkv * gqa, D).transpose(1, 2)
        k, v = z(1, Hkv, N, D), z(1, Hkv, N, D)
        valid = (torch.arange(N) % 7 != 3) if case.variant.endswith("valid") else None
        selected_attention_triton(q, k, v, torch.arange(N - R, N), torch.arange(N), D ** -0.5, valid, out=out)
    elif case.kernel == "lowrank_attention":
        from .lowrank_attention import lowrank_attention_triton

        parts = case.variant.split("-")  # mode[-split]-mask-rank
        mode, mask_kind, r = parts[0], parts[-2], int(parts[-1][1:])
        H, Hkv = 8, 2
        q_len, T = (64, 64) if mode == "prefill" else (1, 256)
        query = z(1, q_len, H, D).transpose(1, 2)
        key, value = z(1, Hkv, T, D), z(1, Hkv, T, D)
        L, Bw, s = z(1, T, r), z(1, Hkv * D, r), z(1)
        mask = {"causal": None, "bool": torch.ones(1, 1, q_len, T, dtype=torch.bool),
                "float": z(1, 1, q_len, T)}[mask_kind]
        lowrank_attention_triton(query, key, value, L, Bw, s, mask, D ** -0.5,
                                 num_splits=4 if "split" in case.variant else None)
    elif case.kernel == "rope_rebase":
        from ..rope import RopeShifter
        from .rope_rebase import rope_rebase_triton

        partial = case.variant.endswith("partial")
        rot = torch.nn.Module()
        rot.register_buffer("inv_freq", 1e4 ** -(torch.arange(0, D // 2 if partial else D, 2) / D))
        shifter = RopeShifter(rot, layout="interleaved" if case.variant.startswith("interleaved") else "half")
        src = z(1, 2, 40, D)
        rope_rebase_triton(src, src, torch.arange(40) - 7, shifter)
    elif case.kernel == "gather_scatter":
        from .gather_scatter import gather_kv_rows_triton, scatter_kv_rows_triton

        k, v = z(1, 2, 64, D), z(1, 2, 64, D)
        rows = torch.tensor([3, 9, 10, 40, 41, 63])
        if case.variant == "gather-kv":
            gather_kv_rows_triton(k, v, rows, check=False)
        else:
            src = z(1, 2, rows.numel(), D, dt=torch.float32)
            scatter_kv_rows_triton(k, v, rows, src, src, check=False)
    elif case.kernel == "deviation":
        from .deviation import token_deviation_triton

        new = z(1, 2, 48, D)
        token_deviation_triton(new, z(1, 2, 48, D), upcast=case.variant != "round", norm=case.variant != "round")
    else:
        raise ValueError(f"unknown kernel {case.kernel!r}")


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, grid, args, kwargs))


def launches(case: Case, target: sizing.Target) -> list[tuple]:
    """The launches (jitted function, grid, args, kwargs) the library makes for ``case`` on ``target``."""
    mod = importlib.import_module(f"{__package__}.{case.kernel}")
    getter = "_kernels" if hasattr(mod, "_kernels") else "_kernel"
    real = getattr(mod, getter)()
    if sizing.interpreted(real[1]):
        raise RuntimeError("Triton's interpreter is on in this process (TRITON_INTERPRET): the compile check needs "
                           "the compiler; run it in a process without TRITON_INTERPRET")
    calls: list = []
    fakes = tuple(_Recorder(k, calls) if i else k for i, k in enumerate(real))
    with mock.patch.object(mod, getter, lambda: fakes), sizing.assume_target(target):
        _run_launcher(case)
    return calls


# ------------------------------------------------------------------------------------------------ compiling


@dataclass
class Result:
    """One compiled launch: what was compiled (kernel, its ``BLOCK_*`` / flag constexprs, warps, stages), what it
    needs (shared memory in bytes; ptxas's registers per thread and spilled bytes per thread) and what exceeds the
    target (``problems``)."""

    case: str
    target: str
    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int
    shared: int = 0
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    seconds: float = 0.0
    cached: bool = False
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _prepare(fn, args: tuple, kwargs: dict, target: sizing.Target):
    """What ``JITFunction.run`` hands ``triton.compile`` for this launch, for ``target`` (no driver needed)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    gpu = GPUTarget("cuda", 10 * target.capability[0] + target.capability[1], 32)
    backend = make_backend(gpu)
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRITON_DEFAULT_FP_FUSION unset: the default a real launch gets, kept
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    return gpu, backend, src, options


def _key(src, backend, options) -> str:
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key

    return hashlib.sha256(get_cache_key(src, backend, options, get_cache_invalidating_env_vars()).encode()).hexdigest()


def _cache_path(key: str) -> str:
    from triton import knobs

    return os.path.join(knobs.cache.dir, "hf_kvreuse_compile_check", f"{key}.json")


def _compile(gpu, src, options) -> tuple[int, dict]:
    """Compile; return the shared memory and ptxas's report (registers, spills) from its log."""
    import triton
    from triton import knobs

    log = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(log):
        warnings.simplefilter("ignore")  # TRITON_DEFAULT_FP_FUSION: the default a real launch gets, kept
        knobs.nvidia.dump_ptxas_log = True  # the register / spill report, printed by the backend
        knobs.compilation.always_compile = True  # a Triton cache hit would skip ptxas and its report
        compiled = triton.compile(src, target=gpu, options=options.__dict__)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return compiled.metadata.shared, dict(registers=int(regs.group(1)) if regs else None,
                                          spill_stores=int(spill.group(1)) if spill else None,
                                          spill_loads=int(spill.group(2)) if spill else None)


def check_limits(res: Result, target: sizing.Target) -> list[str]:
    """What ``res`` exceeds on ``target`` (empty: it fits)."""
    problems = []
    if res.shared > target.shared_memory:
        problems.append(f"shared memory {res.shared:,} B > {target.shared_memory:,} B")
    threads = 32 * res.num_warps
    if res.registers is None:
        problems.append("ptxas reported no register count")
    elif res.registers * threads > sizing.REGISTERS_PER_SM or res.registers > sizing.MAX_REGISTERS_PER_THREAD:
        problems.append(f"{res.registers} registers x {threads} threads > {sizing.REGISTERS_PER_SM:,}")
    if (res.spill_stores or 0) > SPILL_LIMIT or (res.spill_loads or 0) > SPILL_LIMIT:
        problems.append(f"register spills: {res.spill_stores} B stored, {res.spill_loads} B loaded per thread "
                        f"(> {SPILL_LIMIT} B)")
    return problems


def _describe(case: Case, target_name: str, i: int, launch: tuple | None = None) -> tuple:
    """(cache key, Result skeleton, prepared compile inputs) of launch ``i`` of ``case`` (``launch``: it, when
    already recorded)."""
    target = TARGETS[target_name]
    fn, _, args, kwargs = launch or launches(case, target)[i]
    gpu, backend, src, options = _prepare(fn, args, kwargs, target)
    constexprs = {fn.arg_names[k[0]]: v for k, v in src.constants.items()
                  if fn.arg_names[k[0]].isupper()}  # the kernel's own BLOCK_* / flags, not specialised 1s
    res = Result(case.name, target_name, fn.__name__, constexprs, options.num_warps, options.num_stages)
    return _key(src, backend, options), res, (gpu, src, options)


def _compile_job(job: tuple) -> dict:
    """Worker: compile launch ``i`` of ``case`` for ``target_name`` (rebuilt here: jitted functions do not pickle)."""
    case, target_name, i = job
    key, res, (gpu, src, options) = _describe(case, target_name, i)
    t0 = time.perf_counter()
    res.shared, report = _compile(gpu, src, options)
    res.seconds = round(time.perf_counter() - t0, 2)
    for k, v in report.items():
        setattr(res, k, v)
    measured = dict(shared=res.shared, seconds=res.seconds, **report)
    path = _cache_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(measured, f)
    os.replace(tmp, path)
    return measured


def run(selected: list[Case], targets: list[str], jobs: int | None = None, log=print) -> list[Result]:
    """Compile every launch of ``selected`` for ``targets`` (``jobs`` worker processes, default one per CPU) and
    check each against its target's limits; one :class:`Result` per launch, in case order."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        raise RuntimeError("unset TRITON_INTERPRET: the compile check needs Triton's compiler, not its interpreter")
    results, todo, seen = [], {}, {}
    for case in selected:
        for t in targets:
            for i, launch in enumerate(launches(case, TARGETS[t])):
                key, res, _ = _describe(case, t, i, launch)
                results.append((key, res))
                cached = seen.get(key)
                if cached is None and os.path.exists(_cache_path(key)):
                    with open(_cache_path(key)) as f:
                        cached = seen[key] = dict(json.load(f), cached=True)
                if cached is None and key not in todo:
                    todo[key] = (case, t, i)
    if todo:
        log(f"compiling {len(todo)} kernels ({len(results) - len(todo)} launches cached or identical)")
        jobs = jobs or os.cpu_count() or 1
        if jobs > 1 and len(todo) > 1:
            # spawned, not forked: a fork of this process (torch's and LLVM's threads) deadlocked in the children
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
                for key, measured in zip(todo, ex.map(_compile_job, todo.values())):
                    seen[key] = measured
        else:
            for key, job in todo.items():
                seen[key] = _compile_job(job)
    out = []
    for key, res in results:
        for k, v in seen[key].items():
            setattr(res, k, v)
        res.problems = check_limits(res, TARGETS[res.target])
        out.append(res)
    return out


def table(results: list[Result]) -> str:
    """A markdown table of the results."""
    lines = ["| case | target | kernel | tiles | warps | stages | shared B | regs | spills B | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tiles = " ".join(f"{k[6:] if k.startswith('BLOCK_') else k}={v}" for k, v in r.constexprs.items()
                         if k.startswith("BLOCK_"))
        lines.append(f"| {r.case} | {r.target} | {r.kernel} | {tiles} | {r.num_warps} | {r.num_stages} | "
                     f"{r.shared:,} | {r.registers} | {r.spill_stores} | {'yes' if r.ok else '; '.join(r.problems)} |")
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    """A markdown table of the launches two result documents (``--json`` outputs) have in common."""
    key = lambda r: (r["case"], r["target"], r["kernel"])  # noqa: E731
    old = {key(r): r for r in before["results"] if r["shared"] >= 0}

    def cell(r: dict) -> str:
        tiles = "x".join(str(v) for k, v in r["constexprs"].items() if k in ("BLOCK_M", "BLOCK_N"))
        return (f"{tiles}, {r['num_warps']}w/{r['num_stages']}s | {r['shared']:,} | {r['registers']} | "
                f"{r['spill_stores']:,}")

    lines = ["| case | target | before: tiles, warps/stages | shared B | regs | spills B | after: tiles, "
             "warps/stages | shared B | regs | spills B |", "|" + "---|" * 10]
    for r in after["results"]:
        if key(r) in old and r["kernel"] != "lowrank_merge_kernel":
            lines.append(f"| {r['case']} | {r['target']} | {cell(old[key(r)])} | {cell(r)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every case (default: the representative subset)")
    ap.add_argument("--only", nargs="*", help="case names (as listed by --list) to compile")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--json", help="write the results here ('-' for stdout)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="print a table of two --json outputs' common launches and exit")
    args = ap.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            print(compare(json.load(f), json.load(g)))
        return 0
    selected = cases(full=args.full or bool(args.only))
    if args.only:
        selected = [c for c in selected if c.name in set(args.only)]
    if args.list:
        print("\n".join(c.name for c in selected))
        return 0
    import triton

    t0 = time.perf_counter()
    results = run(selected, args.targets, args.jobs, log=lambda m: print(m, file=sys.stderr))
    wall = time.perf_counter() - t0
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    doc = dict(command="python -m hf_kvreuse.triton.compile_check " + " ".join(argv if argv is not None else
                                                                               sys.argv[1:]),
               git_commit=commit, triton=triton.__version__, targets={t: asdict(TARGETS[t]) for t in args.targets},
               wall_s=round(wall, 1), results=[dict(asdict(r), ok=r.ok) for r in results])
    if args.json == "-":
        print(json.dumps(doc))
    else:
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} launches fit their target ({wall:.0f} s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
