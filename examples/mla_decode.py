"""DeepSeek-V3 decode on an H200: multi-head latent attention as transformers runs it
(K and V expanded from the latent for the whole context at every step) against the
absorbed form FlashMLA serves (attention over the latent cache itself).

    python examples/mla_decode.py [--context 4096] [--hardware h200-sxm]
"""

from __future__ import annotations

import argparse

import torchroof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--hardware", default="h200-sxm")
    args = parser.parse_args()
    print(f"DeepSeek-V3 decode, context {args.context}, {args.hardware}")
    print(f"{'batch':>5} {'mla':>9} {'step ms':>9} {'TFLOP':>8} {'GB moved':>9} {'KV GB':>7}")
    for batch in (1, 16, 64):
        for mla in ("expanded", "absorbed"):
            est = torchroof.estimate(
                "deepseek-v3",
                "decode",
                batch=batch,
                context=args.context,
                hardware=args.hardware,
                mla=mla,
            )
            print(
                f"{batch:>5} {mla:>9} {est.time_s * 1e3:>9.2f} {est.flops / 1e12:>8.2f} "
                f"{est.bytes / 1e9:>9.1f} {est.memory.kv_cache_bytes / 1e9:>7.2f}"
            )


if __name__ == "__main__":
    main()
