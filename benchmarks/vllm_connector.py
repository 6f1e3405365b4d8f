"""vLLM fresh vs vLLM with hf_kvreuse's KV connector on a 3-agent workflow, side by side in one engine (CPU build).

Each workflow: a shared document; agent 1 (planner) reads it and answers, agent 2 (solver) gets agent 1's transcript
and a new instruction, agent 3 (reviewer) agent 2's. Every workflow runs twice in the same engine, in alternating
order: **fresh** (the connector off for those requests: vLLM computes every prompt) and **connector** (each finished
request is stored; agents 2 and 3 load their predecessor's prompt + answer as an exact prefix). vLLM's own prefix
cache is off, so the difference is the connector. Per request: TTFT (vLLM's ``first_token_latency``), E2E (wall
time of the call), tokens loaded; per workflow: whether each agent's answer equals the fresh one token for token.
The store's load / save times come from the connector's event log.

Usage (in the vLLM venv, ``make test-vllm`` builds it)::

    PYTHONPATH=. .venvs/vllm/bin/python benchmarks/vllm_connector.py --workflows 8 \\
        --out benchmarks/results/vllm_connector.json
    PYTHONPATH=. .venvs/vllm/bin/python benchmarks/vllm_connector.py --workflows 8 --redis \\
        --out benchmarks/results/vllm_connector_redis.json      # the store on a private redis-server (loopback)

``--redis`` starts a ``redis-server`` on a free 127.0.0.1 port (no persistence, ``allkeys-lru``), runs the same
workflows with the connector's store there (``redis://127.0.0.1:PORT/0``), and stops it.

Writes one JSON (config, git commit, every request, the summary), checkpointed after each workflow.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))

AGENTS = [
    ("planner", "\nPlanner: list the three boxes that hold the most red balls, one per line."),
    ("solver", "\nSolver: for each box the planner listed, give its total number of balls."),
    ("reviewer", "\nReviewer: check the solver's totals against the document and say which are wrong."),
]


def document(w: int, facts: int) -> str:
    lines = [f"Box {w * 100 + i} holds {(i * 7 + w) % 13} red and {(i * 5 + 2 * w) % 11} blue balls."
             for i in range(facts)]
    return "Inventory report.\n" + "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workflows", type=int, default=8)
    ap.add_argument("--facts", type=int, default=40, help="document lines (~17 tokens each)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--store", default=None, help="store folder (default: a fresh temporary one)")
    ap.add_argument("--redis", action="store_true", help="the store on a private redis-server over loopback TCP")
    ap.add_argument("--out", default="benchmarks/results/vllm_connector.json")
    ap.add_argument("--table", default=None, help="print the README table of this JSON and exit (no vLLM needed)")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    from common import write_json
    from hf_kvreuse.models import smollm2_path
    from hf_kvreuse.vllm import CONNECTOR_MODULE, CONNECTOR_NAME
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    torch.set_num_threads(args.threads)
    store = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="kvstore_"))
    if args.store:
        shutil.rmtree(store, ignore_errors=True)
    folder = smollm2_path()
    server = None
    spec = str(store)
    extra = {"store": spec}
    if args.redis:
        from redis_store import start_server

        server, port, _ = start_server(store)
        spec = f"redis://127.0.0.1:{port}/0"
        extra = {"store": spec, "log_dir": str(store / "_log")}  # the event log stays in the folder
    doc = {"config": {**vars(args), "model": str(folder), "store": spec, "vllm": __import__("vllm").__version__,
                      "torch": torch.__version__, "cpu_threads": os.cpu_count(),
                      "note": "fresh and connector arms alternate in one engine (side by side); vLLM prefix "
                              "caching off; TTFT is vLLM's first_token_latency, E2E the wall time of one call"},
           "command": "PYTHONPATH=. python benchmarks/vllm_connector.py " + " ".join(sys.argv[1:]),
           "git_commit": git_commit(), "requests": [], "complete": False}
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype=args.dtype, enforce_eager=True, max_model_len=4096,
              block_size=args.block_size, enable_prefix_caching=False, max_num_seqs=2, seed=0,
              disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
                  kv_load_failure_policy="recompute", kv_connector_extra_config=extra))
    doc["engine_start_s"] = time.perf_counter() - t0
    tok = llm.get_tokenizer()

    def call(ids: list[int], use: bool) -> dict:
        opts = {} if use else {"load": False, "save": False}
        sp = SamplingParams(max_tokens=args.new_tokens, temperature=0, seed=0,
                            extra_args={"kv_transfer_params": {"hf_kvreuse": opts}})
        t = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
        e2e = time.perf_counter() - t
        m = out.metrics
        ttft = getattr(m, "first_token_latency", None) if m is not None else None
        return {"prompt_tokens": len(ids), "loaded_tokens": int(out.num_cached_tokens or 0), "ttft_s": ttft,
                "e2e_s": e2e, "answer": list(out.outputs[0].token_ids)}

    llm.generate({"prompt_token_ids": tok("warm up")["input_ids"]},  # first call pays one-time costs
                 SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": {"hf_kvreuse": {"load": False,
                                                                                                 "save": False}}}),
                 use_tqdm=False)
    for w in range(args.workflows):
        base = tok(document(w, args.facts), add_special_tokens=False)["input_ids"]
        arms = ("fresh", "connector") if w % 2 == 0 else ("connector", "fresh")
        answers = {}
        for arm in arms:
            ids = list(base)
            answers[arm] = []
            for a, (name, instruction) in enumerate(AGENTS):
                ids = ids + tok(instruction + "\n", add_special_tokens=False)["input_ids"]
                r = call(ids, arm == "connector")
                r.update(workflow=w, arm=arm, agent=name, position=a)
                doc["requests"].append(r)
                answers[arm].append(r["answer"])
                ids = ids + r["answer"]
                time.sleep(0.2)  # let the engine store the finished request (a step without new work)
        for a in range(len(AGENTS)):
            doc["requests"][-1 - a]["agrees"] = doc["requests"][-4 - a]["agrees"] = \
                answers["fresh"][-1 - a] == answers["connector"][-1 - a]
        doc["summary"] = summarize(doc["requests"], store)
        write_json(args.out, doc)
        print(f"workflow {w}: {json.dumps(doc['summary']['by_agent'])}", flush=True)
    doc["complete"] = True
    write_json(args.out, doc)
    print(json.dumps(doc["summary"], indent=1))
    del llm
    if server is not None:
        server.terminate()
        server.wait(timeout=30)


def summarize(requests: list[dict], store: Path) -> dict:
    """Per agent position: median TTFT / E2E of both arms and of their per-workflow ratio, tokens loaded, agreement
    (Wilson 95%); the store's load and save times from the connector's worker log."""
    from common import wilson

    med = statistics.median
    by_agent = {}
    for name, _ in AGENTS:
        pairs = {}
        for r in requests:
            if r["agent"] == name:
                pairs.setdefault(r["workflow"], {})[r["arm"]] = r
        pairs = [p for p in pairs.values() if len(p) == 2]
        if not pairs:
            continue
        row = {"n": len(pairs), "prompt_tokens": med(p["fresh"]["prompt_tokens"] for p in pairs),
               "loaded_tokens": med(p["connector"]["loaded_tokens"] for p in pairs),
               "fresh_e2e_s": med(p["fresh"]["e2e_s"] for p in pairs),
               "connector_e2e_s": med(p["connector"]["e2e_s"] for p in pairs),
               "e2e_ratio": med(p["connector"]["e2e_s"] / p["fresh"]["e2e_s"] for p in pairs)}
        if all(p[a]["ttft_s"] for p in pairs for a in ("fresh", "connector")):
            row.update(fresh_ttft_s=med(p["fresh"]["ttft_s"] for p in pairs),
                       connector_ttft_s=med(p["connector"]["ttft_s"] for p in pairs),
                       ttft_speedup=med(p["fresh"]["ttft_s"] / p["connector"]["ttft_s"] for p in pairs))
        k = sum(p["connector"]["answer"] == p["fresh"]["answer"] for p in pairs)
        row.update(identical=k, identical_ci95=wilson(k, len(pairs)))
        by_agent[name] = row
    loads, saves = [], []
    for f in (store / "_log").glob("*-worker.jsonl"):
        for e in map(json.loads, f.read_text().splitlines()):
            (loads if e["event"] == "load" else saves if e["event"] == "save" else []).append(e)
    out = {"by_agent": by_agent}
    if loads:
        out["store_load"] = {"n": len(loads), "median_tokens": med(e["end"] - e["start"] for e in loads),
                             "median_read_s": med(e["read_s"] for e in loads),
                             "median_total_s": med(e["total_s"] for e in loads)}
    if saves:
        out["store_save"] = {"n": len(saves), "median_tokens": med(e["tokens"] for e in saves),
                             "median_gather_s": med(e["gather_s"] for e in saves),
                             "median_write_s": med(e["write_s"] for e in saves),
                             "median_mib": med(e["bytes"] / 2 ** 20 for e in saves)}
    return out


def table(doc: dict) -> str:
    """The README table of one result JSON."""
    from common import markdown_table

    s = doc["summary"]
    rows = [{"agent": name, **r} for name, r in s["by_agent"].items()]
    f = lambda key, d=2: (lambda r: f"{r[key]:.{d}f}" if key in r else "-")  # noqa: E731
    cols = [("agent", lambda r: r["agent"]), ("n", lambda r: str(r["n"])),
            ("prompt tok", f("prompt_tokens", 0)), ("loaded tok", f("loaded_tokens", 0)),
            ("TTFT fresh (s)", f("fresh_ttft_s")), ("TTFT connector (s)", f("connector_ttft_s")),
            ("TTFT speed-up", lambda r: f"{r['ttft_speedup']:.2f}x" if "ttft_speedup" in r else "-"),
            ("E2E fresh (s)", f("fresh_e2e_s")), ("E2E connector (s)", f("connector_e2e_s")),
            ("E2E ratio", f("e2e_ratio")),
            ("identical answers", lambda r: f"{r['identical']}/{r['n']} "
                                            f"[{r['identical_ci95'][0]:.2f}, {r['identical_ci95'][1]:.2f}]")]
    out = markdown_table(rows, cols)
    if "store_load" in s:
        ld = s["store_load"]
        out += (f"\n\nStore load (median of {ld['n']}): {ld['median_tokens']:.0f} tokens, read + verify "
                f"{ld['median_read_s'] * 1e3:.0f} ms, into vLLM's blocks in all {ld['median_total_s'] * 1e3:.0f} ms.")
    if "store_save" in s:
        sv = s["store_save"]
        out += (f" Store save (median of {sv['n']}): {sv['median_tokens']:.0f} tokens, {sv['median_mib']:.1f} MiB, "
                f"gather from the blocks {sv['median_gather_s'] * 1e3:.0f} ms, write "
                f"{sv['median_write_s'] * 1e3:.0f} ms.")
    return out


if __name__ == "__main__":
    main()
