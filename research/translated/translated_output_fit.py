"""Output-level fitting of a closed-form KVMapper on the offline Qwen2.5-Coder 0.5B -> 1.5B pair (issue 24, 2d).

Fine-tunes the map so that the frozen 1.5B target, reading the mapped cache, predicts what its full prefill predicts
(KL on the teacher's greedy answer tokens; :mod:`hf_kvreuse.translation.output_fit`). Calibration: DROP prompts in
the chat QA format (the closed form's data), the last ``--n-val`` of them held out for early stopping; the test
set (SQuAD, ``research/translated/translated_retention.py``) is never seen. Writes the fitted map (safetensors + JSON) and one
result JSON (config, seed, git commit, KL and teacher-forced top-1 agreement before and after, per epoch)::

    python research/translated/translated_output_fit.py --map /tmp/tr24/maps/kv_ab --n-train 48 --n-val 12 --epochs 4 \\
        --lr 1e-4 --out-map /work/runs/kl/map --result benchmarks/results/translated_output_fit.json

then the retention of both maps on the same prepared SQuAD items::

    python research/translated/translated_retention.py run --n 30 --map kv_ab=/tmp/tr24/maps/kv_ab --map kl=/work/runs/kl/map \\
        --config kv_ab:0.0:random --config kl:0.0:random --config kv_ab:0.3:first-layer --config kl:0.3:first-layer
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    from hf_kvreuse.models import load_qwen
    from hf_kvreuse.translation import KVMapper
    from hf_kvreuse.translation.output_fit import (OutputFitConfig, fit_outputs, load_examples, make_examples,
                                                   output_kl, save_examples)
    from hf_kvreuse.translation.pairs import calibration_ids

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--map", required=True, help="the closed-form map to start from (a KVMapper folder)")
    p.add_argument("--n-train", type=int, default=48, help="DROP calibration prompts to fit on")
    p.add_argument("--n-val", type=int, default=12, help="DROP prompts after them, for early stopping")
    p.add_argument("--offset", type=int, default=0, help="first DROP passage")
    p.add_argument("--max-tokens", type=int, default=320, help="prompt length cap")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--anchor", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=None, help="stop after the epoch past this many seconds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--examples", default=None, help="folder keeping the teacher pass (examples.safetensors + .json; made if absent)")
    p.add_argument("--out-map", required=True, help="folder of the fitted map")
    p.add_argument("--result", default=str(HERE.parents[1] / "benchmarks" / "results" / "translated_output_fit.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_start = time.perf_counter()
    src, tok = load_qwen("0.5b", dtype=torch.float32)
    tgt, _ = load_qwen("1.5b", dtype=torch.float32)
    mapper = KVMapper.load(a.map, src, tgt)
    prompts = calibration_ids(tok, a.n_train + a.n_val, a.max_tokens, offset=a.offset)
    t0 = time.perf_counter()
    cached = Path(a.examples) if a.examples else None
    if cached is not None and (cached / "examples.json").exists():
        examples = load_examples(cached)
        if [x.ids.tolist() for x in examples] != [x.tolist() for x in prompts] or \
                any(x.answer.numel() != a.answer_tokens for x in examples):
            raise SystemExit(f"{cached} holds other prompts or answer lengths than this command's")
    else:
        examples = make_examples(src, tgt, prompts, mapper, answer_tokens=a.answer_tokens)
        if cached is not None:
            save_examples(examples, cached)
    prep_s = time.perf_counter() - t0
    train, val = examples[:a.n_train], examples[a.n_train:]
    cfg = OutputFitConfig(answer_tokens=a.answer_tokens, epochs=a.epochs, lr=a.lr, anchor=a.anchor, seed=a.seed)
    before = {"train": output_kl(mapper, tgt, train), "val": output_kl(mapper, tgt, val)}
    print("closed form:", before, flush=True)
    result_path = Path(a.result)
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": "python research/translated/translated_output_fit.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": vars(a), "config": cfg.__dict__, "git_commit": subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip(),
              "torch_threads": a.threads, "dtype": "float32", "base_map": a.map, "base_map_info": mapper.info,
              "prompt_tokens": [int(x.numel()) for x in prompts], "teacher_prep_s": prep_s, "before": before,
              "date": time.strftime("%F %T")}

    def checkpoint(fitted, rec):
        print("epoch", rec, flush=True)
        result["history_so_far"] = result.get("history_so_far", []) + [rec]
        result_path.write_text(json.dumps(result, indent=1))

    t1 = time.perf_counter()
    fitted, history = fit_outputs(mapper, tgt, train, cfg, val_examples=val, budget_s=a.budget_s,
                                  on_epoch=checkpoint)
    result["fit_s"] = time.perf_counter() - t1
    result["history"] = history
    result.pop("history_so_far", None)
    result["after"] = {"train": output_kl(fitted, tgt, train), "val": output_kl(fitted, tgt, val)}
    result["best_epoch"] = fitted.info["output_fit"]["best_epoch"]
    fitted.save(a.out_map)
    result["out_map"] = a.out_map
    result["total_s"] = time.perf_counter() - t_start
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=1))
    print("fitted:", result["after"], "best epoch", result["best_epoch"], flush=True)


if __name__ == "__main__":
    main()
