"""Draw the roofline of a traced training step, one point per kernel, and its per-layer
budget; the README's picture is this script's output.

    python examples/roofline_plot.py [--model llama-3-8b] [--seq 4096] [--out examples/]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torchroof
from torchroof.render import text
from torchroof.render.plots import layer_plot, roofline_plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    est = torchroof.estimate(
        args.model, "train", seq=args.seq, precision="bf16", hardware=args.hardware
    )
    out = Path(args.out)
    print(roofline_plot(est, out / f"{args.model}-train-roofline.png"))
    print(layer_plot(est, out / f"{args.model}-train-layers.png", depth=None))
    print(text.summary(est))


if __name__ == "__main__":
    main()
