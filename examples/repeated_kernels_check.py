"""Kernels of repeated layers built once against grouping every op, on the zoo's diverse
set of architectures: for each architecture's prefill and decode step (copied layers, as
an estimate traces it), the kernels under the fused, eager and epilogue policies built
once per repeated period (torchroof/kernels/repeats.py) and op by op must be equal.
Writes ``tests/data/repeated_kernels.json``, which tests/test_repeated_kernels.py reads
(the whole set takes several minutes here; the test reruns three).

    python examples/repeated_kernels_check.py [--out tests/data/repeated_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from copied_layers_check import ARCHITECTURES

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "repeated_kernels.json"
REGIMES = ("prefill", "decode")  # a training step is grouped whole


def main() -> int:
    from torchroof.validation.zoo import repeated_kernels_check

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = []
    for architecture in ARCHITECTURES:
        for regime in REGIMES:
            start = time.perf_counter()
            check = repeated_kernels_check(architecture, regime)
            rows.append(
                {
                    "architecture": architecture,
                    "regime": regime,
                    "periods": check.periods,
                    "length": check.length,
                    "kernels": check.kernels,
                    "built_once": check.built_once,
                    "differences": check.differences,
                }
            )
            seconds = time.perf_counter() - start
            same = "same" if not check.differences else f"DIFFERS: {check.differences}"
            built = (
                f"{check.periods} periods of {check.length} ops, built once: "
                f"{', '.join(check.built_once) or 'none (grouped whole)'}"
                if check.periods
                else "no run"
            )
            print(f"{architecture:16s} {regime:8s} {same} ({seconds:.1f} s) {built}", flush=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0 if all(not r["differences"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
