"""Run several ``research/latent/latent_ablations.sh`` ablations in one process, one Python thread each (each runs its
torch work single-threaded: ``torch.set_num_threads(1)``), sharing one copy of the model and of the data in memory.
Each still writes its own result JSON (its ``command`` field is the equivalent single command) and counts its own
thread's CPU seconds against its budget, so the figures are those of the single commands.

    python research/latent/latent_ablations_threads.py n4 n16 wide
"""

import shlex
import subprocess
import sys
import threading

import torch

from hf_kvreuse import enable
from hf_kvreuse.latent.train import run
from hf_kvreuse.models import load_offline


def commands(names):
    """The argv of each named ablation as latent_ablations.sh runs it (its ``python`` replaced by an echo)."""
    out = {}
    for name in names:
        line = subprocess.run(["bash", "-c", 'python() { printf "%q " "$@"; }; export -f python; '
                               f"bash research/latent/latent_ablations.sh {shlex.quote(name)}"],
                              capture_output=True, text=True).stdout.strip()
        argv = shlex.split(line)
        if argv[:2] != ["-m", "hf_kvreuse.latent.train"]:
            raise ValueError(f"unknown ablation {name!r}: {line}")
        out[name] = argv[2:]
    return out


def main(names):
    torch.set_num_threads(1)
    cmds = commands(names)
    model, _ = load_offline("qwen2.5-0.5b", dtype=torch.float32)
    enable(model)
    loaded = {}
    first = next(iter(cmds.values()))
    from hf_kvreuse.latent.data import load_examples

    errors = []

    def one(name, argv):
        try:
            res = run(argv, model=model, loaded=loaded)
            print(name, res["bridge"].get("step"), res.get("dev", {}).get("all"), flush=True)
        except Exception as exc:  # noqa: BLE001
            errors.append((name, repr(exc)))
            raise

    # load the shared data once, before the threads start (run() looks it up by (data, families, max per family))
    data_dir = first[first.index("--data") + 1]
    loaded[(data_dir, (), None)] = load_examples(data_dir)
    if "--dev" in first:
        dev = first[first.index("--dev") + 1]
        loaded[dev] = load_examples(dev)
    threads = [threading.Thread(target=one, args=(n, argv), name=n) for n, argv in cmds.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"failed: {errors}")


if __name__ == "__main__":
    main(sys.argv[1:])
