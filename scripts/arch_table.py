"""Print the architecture table: which caches reproduce which architecture, and why the others refuse.

For every architecture of :mod:`hf_kvreuse.models.arch_zoo` (tiny random-init configs of the installed transformers) it
runs :func:`hf_kvreuse.model_check.check_model` and every exactness check of ``tests/test_architectures.py``
(:func:`hf_kvreuse.models.arch_zoo.run_check`), and prints a markdown table (the one in docs/ARCHITECTURES.md):

    .venv/bin/python scripts/arch_table.py                 # every zoo architecture (~30 s on one CPU core)
    .venv/bin/python scripts/arch_table.py llama cohere    # some of them

A cache "works" when every check of it passed (DirectReuseCache: self-control and layer-0 re-positioning;
BlendCache: self-control and full recompute). "refused" means its constructor raised a ValueError naming the
model. "WRONG" / "ERROR" would be a library bug (a wrong output, or an exception other than a refusal).
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_kvreuse import enable  # noqa: E402
from hf_kvreuse.models.arch_zoo import SPECS, run_check, zoo_configs, zoo_model  # noqa: E402
from hf_kvreuse.model_check import check_model  # noqa: E402

#: cache -> the checks it must pass
CACHES = {
    "OptimisticCache": ("optimistic",),
    "DirectReuseCache": ("direct", "reposition"),
    "EPICCache": ("epic",),
    "TailRecomputeCache": ("tail",),
    "BlendCache": ("blend", "blend_full"),
    "OffsetCache": ("offset",),
}
SHORT = {"OptimisticCache": "Optimistic", "DirectReuseCache": "Direct", "EPICCache": "EPIC",
         "TailRecomputeCache": "Tail", "BlendCache": "Blend", "OffsetCache": "Offset"}


def short_reason(msg: str) -> str:
    """A few words for a refusal message of the model check."""
    rules = [
        (r"has no rotary embedding", "no `inv_freq` rotary module (no RoPE, or RoPE the library does not find)"),
        (r"matches neither the half-split nor the interleaved", "RoPE layout is neither half-split nor interleaved"),
        (r"depend on absolute positions beyond RoPE", "K/V depend on absolute positions beyond RoPE"),
        (r"layer-range recompute is not available", "layer-range engine needs the Llama layout"),
        (r"running its decoder layers directly does not reproduce", "its forward does more around the layers "
                                                                     "(e.g. embedding multiplier)"),
        (r"partial recompute fails", "partial-recompute engine fails"),
        (r"does not reproduce a plain forward", "partial-recompute engine is not exact"),
        (r"sliding", "sliding-window layers"),
        (r"linear-attention / recurrent-state", "linear-attention / recurrent-state layers"),
        (r"rope_type=", "length-dependent rope_type"),
    ]
    for pattern, text in rules:
        if re.search(pattern, msg):
            layer = re.search(r"keys of layer (\d+)", msg)
            return text + (f" (layer {layer.group(1)})" if layer and "absolute" in text else "")
    return msg[:80]


def cache_outcome(model, checks) -> str:
    """"works" when every check passed, "refused: <reason>", or "WRONG" / "ERROR" (a library bug)."""
    for check in checks:
        try:
            refusal = run_check(model, check)
        except AssertionError as e:
            return f"WRONG ({check}: {str(e).splitlines()[0][:100]})"
        except Exception as e:  # noqa: BLE001 - any other error is a bug to report
            return f"ERROR ({check}: {type(e).__name__}: {str(e)[:100]})"
        if refusal is not None:
            return "refused: " + short_reason(refusal)
    return "works"


def verdict(arch: str) -> dict:
    model = enable(zoo_model(arch))
    report = check_model(model)
    caches = {cache: cache_outcome(model, checks) for cache, checks in CACHES.items()}
    cfg = model.config
    try:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    except Exception:  # noqa: BLE001 - heterogeneous configs (per-layer head_dim) refuse the global read
        head_dim = "?"
    layout = (f"{report.rope_layout}, {report.rotary_dim}/{head_dim} dims" if report.rope_layout else "-")
    return {"arch": arch, "cls": type(model).__name__, "attn": cfg._attn_implementation, "layout": layout,
            "caches": caches}


def markdown(rows) -> str:
    lines = ["| architecture | class | RoPE layout (rotary / head dims) | caches that work "
             "| refused (reason); ERROR or WRONG = library bug |",
             "|---|---|---|---|---|"]
    for r in rows:
        works = [SHORT[c] for c, o in r["caches"].items() if o == "works"]
        other: dict[str, list[str]] = {}
        for c, o in r["caches"].items():
            if o != "works":
                other.setdefault(o.removeprefix("refused: "), []).append(SHORT[c])
        refused = "; ".join(f"{', '.join(cs)}: {why}" for why, cs in other.items())
        arch = r["arch"] + (" (eager)" if r["attn"] == "eager" else "")
        lines.append(f"| {arch} | {r['cls']} | {r['layout']} | {', '.join(works) or '-'} | {refused or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", help=f"zoo architectures (default: all {len(SPECS)})")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny models: more threads only add synchronisation
    archs = args.archs or list(zoo_configs())
    rows = [verdict(a) for a in archs]
    print(markdown(rows))
    bad = [r["arch"] for r in rows if any(o.startswith(("WRONG", "ERROR")) for o in r["caches"].values())]
    if bad:
        print(f"\nlibrary bugs (wrong output or a non-refusal error): {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
