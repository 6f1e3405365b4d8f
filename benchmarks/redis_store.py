"""Save and load latency of one K/V store entry: the folder store vs the Redis store (loopback), side by side.

Entries have SmolLM2-135M's K/V geometry (read from the model's own cache: layers, KV heads, head dim, dtype) and
1k / 4k / 8k tokens of random values. Per size and repeat, in alternating order:

* ``folder``: :class:`~hf_kvreuse.vllm.store.KVDirStore` (safetensors + JSON, temporary file renamed; fsync);
* ``folder-protocol``: :class:`~hf_kvreuse.stores.tiers.KVEntryStore` on :class:`~hf_kvreuse.stores.FolderBackend`
  (one file per entry);
* ``redis-tcp``: the same store on a private ``redis-server`` over 127.0.0.1 TCP;
* ``redis-unix``: over its unix socket.

``save`` is ``put`` (a new entry each time), ``load`` is ``load`` of that entry, both with every check the stores
do (sha256, fields, shapes, finite values). The server runs with persistence off (a cache, as the docs advise).

Usage::

    PYTHONPATH=. python benchmarks/redis_store.py --repeats 5 --out benchmarks/results/redis_store.json

Writes the JSON (config, commit, every sample, medians) and a plot next to it.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

MODES = ["folder", "folder-protocol", "redis-tcp", "redis-unix"]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def start_server(tmp: Path) -> tuple[subprocess.Popen, int, Path]:
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = tmp / "redis.sock"
    proc = subprocess.Popen([shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--unixsocket",
                             str(sock), "--save", "", "--appendonly", "no", "--maxmemory", "6gb",
                             "--maxmemory-policy", "allkeys-lru", "--proto-max-bulk-len", "2gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            redis.Redis(port=port).ping()
            return proc, port, sock
        except redis.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def write(args, samples, layers, heads, dim) -> list[dict]:
    """Medians per size and mode, written with every sample to ``args.out`` (called after each size)."""
    summary = []
    for n in sorted({x['tokens'] for x in samples}):
        for mode in MODES:
            s = [x for x in samples if x["tokens"] == n and x["mode"] == mode]
            summary.append(dict(tokens=n, mode=mode, bytes=s[0]["bytes"],
                                save_ms=1e3 * statistics.median(x["save_s"] for x in s),
                                load_ms=1e3 * statistics.median(x["load_s"] for x in s)))
    for row in summary:
        ref = next(x for x in summary if x["tokens"] == row["tokens"] and x["mode"] == "folder")
        row["save_vs_folder"], row["load_vs_folder"] = row["save_ms"] / ref["save_ms"], row["load_ms"] / ref["load_ms"]
        print(f"{row['tokens']:>5} {row['mode']:<16} {row['bytes'] / 2**20:7.1f} MiB  save {row['save_ms']:8.1f} ms "
              f"({row['save_vs_folder']:.2f}x)  load {row['load_ms']:8.1f} ms ({row['load_vs_folder']:.2f}x)")
    import redis

    doc = dict(config=dict(vars(args), layers=layers, kv_heads=heads, head_dim=dim, model="smollm2-135m-instruct",
                           redis_server=subprocess.run([shutil.which("redis-server"), "--version"], capture_output=True,
                                                       text=True).stdout.strip(), redis_py=redis.__version__,
                           machine=platform.machine(), python=platform.python_version(), torch=torch.__version__),
               commit=git_commit(), summary=summary, samples=samples)
    write_json(args.out, doc)
    return summary


LABELS = {"folder": "folder", "redis-tcp": "Redis TCP", "redis-unix": "Redis unix socket",
          "folder-protocol": "folder-protocol"}


def table(doc: dict) -> str:
    """The markdown table of a results JSON (save / load medians; ratios against the folder store)."""
    rows = doc["summary"]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    out = ["| tokens | entry | " + " | ".join(f"{LABELS.get(m, m)} save / load" for m in modes) + " |",
           "|---|---|" + "---|" * len(modes)]
    for n in sorted({r["tokens"] for r in rows}):
        cells = []
        for m in modes:
            r = next(x for x in rows if x["tokens"] == n and x["mode"] == m)
            cell = f"{r['save_ms']:.0f} / {r['load_ms']:.0f} ms"
            if m != "folder":
                cell += f" ({r['save_vs_folder']:.2f}x / {r['load_vs_folder']:.2f}x)"
            cells.append(cell)
        mib = next(x for x in rows if x["tokens"] == n)["bytes"] / 2**20
        out.append(f"| {n} | {mib:.0f} MiB | " + " | ".join(cells) + " |")
    note = doc["config"].get("note")
    if note:
        out += ["", f"Recorded with the run: {note}."]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results/redis_store.json")
    ap.add_argument("--note", default="", help="e.g. 'taken under load: other jobs shared the 2 CPU cores'")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (Debian: apt-get install redis-server)")

    from hf_kvreuse.models import load_smollm2
    from hf_kvreuse.persist import kv_layout
    from hf_kvreuse.stores import FolderBackend
    from hf_kvreuse.stores.tiers import KVEntryStore
    from hf_kvreuse.vllm import KVDirStore, ModelIdentity

    dtype = getattr(torch, args.dtype)
    layout = kv_layout(load_smollm2(dtype=dtype)[0])
    layers, (heads, dim) = layout.layers, layout.shapes[0]
    identity = ModelIdentity("0" * 64, args.dtype, "smollm2-135m-instruct")
    tmp = Path(tempfile.mkdtemp(prefix="kvstore_bench_"))  # on disk here (check where TMPDIR points)
    proc, port, sock = start_server(Path(tempfile.mkdtemp(prefix="kvstore_sock_")))
    samples = []
    try:
        stores = {"folder": KVDirStore(tmp / "dir"), "folder-protocol": KVEntryStore(FolderBackend(tmp / "proto")),
                  "redis-tcp": KVEntryStore(f"redis://127.0.0.1:{port}/0"),
                  "redis-unix": KVEntryStore(f"unix://{sock}")}
        g = torch.Generator().manual_seed(0)
        for n in args.tokens:
            k = torch.randn(layers, heads, n, dim, generator=g).to(dtype)
            v = torch.randn(layers, heads, n, dim, generator=g).to(dtype)
            nbytes = 2 * k.numel() * k.element_size()
            for r in range(args.repeats + 1):  # repeat 0 warms up (page cache, connections), not recorded
                order = MODES if r % 2 == 0 else MODES[::-1]
                for mode in order:
                    store = stores[mode]
                    ids = [r * 1_000_000 + i for i in range(n)]
                    t0 = time.perf_counter()
                    info = store.put(identity, ids, k, v)
                    t1 = time.perf_counter()
                    k2, v2 = store.load(info, identity)
                    t2 = time.perf_counter()
                    assert torch.equal(k2, k) and torch.equal(v2, v)
                    if r:
                        samples.append(dict(mode=mode, tokens=n, bytes=nbytes, repeat=r, save_s=t1 - t0,
                                            load_s=t2 - t1))
                    # drop the entry (keeps memory and disk flat)
                    if mode == "folder":
                        for p in (tmp / "dir").glob(f"{info.entry_id}*"):
                            p.unlink()
                    else:
                        store.backend.delete(store._ns(identity), info.entry_id)
                print(f"{n} tokens, repeat {r} done", flush=True)
            summary = write(args, samples, layers, heads, dim)
    finally:
        proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = write(args, samples, layers, heads, dim)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        w = 0.8 / len(MODES)
        for ax, what in zip(axes, ("save_ms", "load_ms")):
            for j, mode in enumerate(MODES):
                ys = [next(x[what] for x in summary if x["tokens"] == n and x["mode"] == mode) for n in args.tokens]
                ax.bar([i + j * w for i in range(len(args.tokens))], ys, w, label=mode)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(args.tokens))], [f"{n} tok" for n in args.tokens])
            ax.set_yscale("log")
            ax.set_ylabel("ms (median)")
            ax.set_title(what.replace("_ms", "") + f" ({args.dtype}, SmolLM2-135M K/V)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
