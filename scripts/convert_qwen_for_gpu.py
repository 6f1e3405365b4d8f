"""Write the Qwen2.5-Coder-1.5B folder that the prepared GPU check (scripts/gpu_check.sh, real_scale step) reads:
convert on the CPU beforehand, so no lease time goes to it.

    python scripts/convert_qwen_for_gpu.py --out benchmarks/assets/qwen2.5-coder-1.5b          # config + tokenizer
    python scripts/convert_qwen_for_gpu.py --out benchmarks/assets/qwen2.5-coder-1.5b --weights  # + bf16 weights

The device tool carries at most 64 MiB of ignored paths: config and tokenizer (~11 MiB) travel; the bf16
weights (~3.1 GB) do not. Without weights in the folder, the check builds a random-init model of the same config
(recorded as ``weights: "random"`` in its JSON: timing does not depend on the weights). The folder holds
``config.json``, the tokenizer files, ``model.safetensors`` with ``--weights`` and ``conversion.json`` (source,
dtype, sizes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


#: Qwen2.5-Coder-1.5B's sizes (its config.json); every other field as the 0.5B's
SIZES_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, max_window_layers=21, tie_word_embeddings=True)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "assets" / "qwen2.5-coder-1.5b")
    ap.add_argument("--weights", action="store_true", help="also write the bf16 weights (~3.1 GB: does not travel)")
    ap.add_argument("--size", default="1.5b", choices=["0.5b", "1.5b"])
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from hf_kvreuse.models.loaders import load_qwen, model_path

    args.out.mkdir(parents=True, exist_ok=True)
    if args.weights:
        model, tok = load_qwen(args.size, dtype=torch.bfloat16)
        tok.save_pretrained(args.out)
        model.save_pretrained(args.out, safe_serialization=True)
    else:
        # no conversion needed: the 0.5B folder's tokenizer (the pair shares it) and its config, resized
        small = model_path("qwen2.5-0.5b")
        AutoTokenizer.from_pretrained(small, local_files_only=True).save_pretrained(args.out)
        d = AutoConfig.from_pretrained(small, local_files_only=True).to_dict()
        if args.size == "1.5b":
            d.update(SIZES_1_5B)
            d.pop("layer_types", None)  # derived again from the layer count
        d["torch_dtype"] = d["dtype"] = "bfloat16"
        AutoConfig.for_model(**d).save_pretrained(args.out)
        for old in args.out.glob("*.safetensors"):  # a folder without weights must not keep stale ones
            old.unlink()
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    info = dict(model=f"Qwen2.5-Coder-{args.size.upper()}-Instruct", dtype="bfloat16", weights=args.weights,
                date=time.strftime("%Y-%m-%d %H:%M"), bytes=sizes)
    (args.out / "conversion.json").write_text(json.dumps(info, indent=1))
    total = sum(sizes.values()) / 2 ** 20
    print(f"wrote {args.out} ({total:.1f} MiB{'' if total <= 64 else ': over the 64 MiB the device tool carries'})")
    return args.out


if __name__ == "__main__":
    main()
