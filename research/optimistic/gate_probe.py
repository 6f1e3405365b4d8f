"""Issue 23 probe: measured points of the commit-mode confidence gate's agreement-vs-TTFT curve.

``hf-kvreuse bench`` names one gate setting, ``auto-commit-gate`` (``gate=0.5``). This script registers, for this
process only, a mode ``auto-commit-gate<t>`` for every such name in ``--methods`` (``t`` a threshold in (0, 1],
e.g. ``auto-commit-gate0.2``: ``policy="auto", rebase="commit", gate=t``), optionally with a repair of the
optimistic cache before the first token: ``auto-commit-gate<t>-blend<r>`` (``repair="blend", repair_ratio=r``,
r in (0, 1]) or ``auto-commit-gate<t>-epic<k>`` (``repair="epic", repair_tokens=k``, k >= 1: the first k rows of
every reused span), and a suffix ``-unfused`` for RebaseKV's two forwards before the first token
(``fuse_first_step=False``: the unmatched rows' forward, then a one-token decode step; the default fuses them into
one), then runs ``hf-kvreuse bench`` with the arguments given. With ``--reference`` to an earlier
run's full-prefill records, only the new modes run:

    python research/optimistic/gate_probe.py --model qwen2.5-0.5b --dtype fp32 --workflows fully_connected \\
        --context-tokens 1000 --methods auto-commit-gate0.2 --n 25 --seed 0 --threads 1 --max-new-tokens 16 \\
        --questions 0:13 --reference benchmarks/results/bench/fp32_s0/bench.json --out /work/runs/gate02_s0
    python research/optimistic/gate_curve.py MERGED/bench.json --measured MERGED/bench.json   # bound vs measured
"""

import re
import sys

from hf_kvreuse import session
from hf_kvreuse.cli import main

_NAME = re.compile(r"auto-commit-gate(\d*\.?\d+)(?:-(blend|epic)(\d*\.?\d+))?(-unfused)?$")


def register(methods: str) -> list[str]:
    """Register every ``auto-commit-gate<t>[-blend<r>|-epic<k>][-unfused]`` of a comma-separated method list; returns the
    names registered."""
    names = []
    for m in methods.split(","):
        match = _NAME.match(m.strip())
        if match is None:
            continue
        t = float(match.group(1))
        if not 0.0 < t <= 1.0:
            raise SystemExit(f"{m}: the gate threshold must be in (0, 1]")
        kwargs = dict(gate=t)
        if match.group(2) == "blend":
            r = float(match.group(3))
            if not 0.0 < r <= 1.0:
                raise SystemExit(f"{m}: the blend repair ratio must be in (0, 1]")
            kwargs.update(repair="blend", repair_ratio=r)
        elif match.group(2) == "epic":
            k = float(match.group(3))
            if k != int(k) or k < 1:
                raise SystemExit(f"{m}: the epic repair needs a whole number of rows >= 1 per span")
            kwargs.update(repair="epic", repair_tokens=int(k))
        if match.group(4):
            kwargs.update(fuse_first_step=False)
        session.MODES[m.strip()] = dict(policy="auto", rebase="commit", method_kwargs=kwargs)
        names.append(m.strip())
    return names


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--methods" in args:
        register(args[args.index("--methods") + 1])
    sys.exit(main(["bench", *args]))
