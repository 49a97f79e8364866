"""Repeated layers copied against every layer run, on the zoo's diverse set of
architectures: for each architecture and regime, the step traced twice (``full_trace=True``
and the default) and held to each other op for op, the copied trace priced. Writes
``tests/data/copied_layers.json``, which tests/test_copied_layers.py reads (the live
comparison of all 29 x 3 steps takes about ten minutes here; the test reruns three).

    python examples/copied_layers_check.py [--out tests/data/copied_layers.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "copied_layers.json"
# the zoo's regression set (tests/test_zoo.py DIVERSE)
ARCHITECTURES = (
    *("llama", "gpt2", "gemma2", "phi3", "olmo2", "falcon", "gpt_neox", "opt", "bloom"),
    *("cohere", "mistral", "qwen3", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3"),
    *("mamba", "mamba2", "jamba", "qwen3_next", "falcon_h1", "recurrent_gemma", "zamba2"),
    *("minimax", "lfm2", "bart", "t5", "bert"),
)
REGIMES = ("prefill", "decode", "train")


def main() -> int:
    from torchroof.validation.zoo import replay_check

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = []
    for architecture in ARCHITECTURES:
        for regime in REGIMES:
            start = time.perf_counter()
            check = replay_check(architecture, regime)
            rows.append(
                {
                    "architecture": architecture,
                    "regime": regime,
                    "difference": check.difference,
                    "uncounted": check.uncounted,
                    "repeated_layers": check.repeated_layers,
                }
            )
            seconds = time.perf_counter() - start
            same = "same" if not check.difference else f"DIFFERS: {check.difference}"
            print(
                f"{architecture:16s} {regime:8s} {same} ({seconds:.1f} s) {check.repeated_layers}"
            )
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0 if all(not r["difference"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
