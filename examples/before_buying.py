"""Before buying hardware: one model, every candidate accelerator, decode and training.

python examples/before_buying.py [--model llama-3-8b] [--batch 32] [--context 8192]
"""

from __future__ import annotations

import argparse

from torchroof.render import text
from torchroof.studies import compare

CANDIDATES = ["h100-sxm", "h200-sxm", "b200", "mi300x", "a100-sxm", "l40s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    vary = {"hardware": CANDIDATES}
    print(f"{args.model} decode, batch {args.batch}, context {args.context}")
    print(
        text.variants_table(
            compare(args.model, vary, regime="decode", batch=args.batch, context=args.context)
        )
    )
    print()
    print(f"{args.model} training step, 1 x {args.seq} tokens, AdamW, mixed precision")
    print(
        text.variants_table(
            compare(args.model, vary, regime="train", seq=args.seq, precision="mixed")
        )
    )


if __name__ == "__main__":
    main()
