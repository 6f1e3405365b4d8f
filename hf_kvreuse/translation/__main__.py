"""``python -m hf_kvreuse.translation fit [--refit] [--calibration N] [--max-tokens T] [--stride S] [--out DIR]``:
fit (or load) the offline Qwen2.5-Coder 0.5B -> 1.5B KV map and print what it found."""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hf_kvreuse.translation", description=__doc__)
    p.add_argument("command", choices=["fit"])
    p.add_argument("--refit", action="store_true", help="fit again even if a saved map exists")
    p.add_argument("--calibration", type=int, default=64, help="calibration prompts (DROP)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--out", default=None, help="folder of the map (default: $HF_KVREUSE_CACHE/maps/...)")
    a = p.parse_args(argv)
    from .pairs import default_map_path, qwen_pair_mapper

    t0 = time.perf_counter()
    mapper = qwen_pair_mapper(path=a.out, n_calibration=a.calibration, max_tokens=a.max_tokens, stride=a.stride,
                              refit=a.refit)
    print(mapper)
    print(f"fit_s={mapper.info.get('fit_s', 0):.1f} (this call {time.perf_counter() - t0:.1f} s), "
          f"calibration tokens={mapper.info.get('calibration_tokens')}, saved at {a.out or default_map_path()}")
    print("source layers per target layer:", [lm.sources for lm in mapper.layers])


if __name__ == "__main__":
    main()
