"""Steps traced once with their sizes as symbols against fresh estimates, on the zoo's
diverse set of architectures: each prefill and decode step is prepared at one batch and
length and priced at six points (batch 1 to 16, lengths 17 to 100), in the pure and the
realistic timing mode; every point's figures and estimate must equal a fresh estimate's.
Writes ``tests/data/symbolic_check.json``, which tests/test_symbolic_check.py reads (the
whole set takes a quarter of an hour here; the test reruns two).

    python examples/symbolic_check.py [--out tests/data/symbolic_check.json] [--arch NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from copied_layers_check import ARCHITECTURES

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "symbolic_check.json"
REGIMES = ("prefill", "decode")  # the regimes traced with their sizes as symbols


def main() -> int:
    from torchroof.validation.symbolic_check import symbolic_check

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--arch", action="append", help="only these (the file keeps the rest)")
    args = parser.parse_args()
    rows = json.loads(args.out.read_text()) if args.arch and args.out.exists() else []
    rows = [r for r in rows if r["architecture"] not in (args.arch or ())]
    for architecture in args.arch or ARCHITECTURES:
        for regime in REGIMES:
            start = time.perf_counter()
            check = symbolic_check(architecture, regime)
            rows.append({"architecture": architecture, "regime": regime, **asdict(check)})
            seconds = time.perf_counter() - start
            same = "same" if not check.differences else f"DIFFERS: {check.differences}"
            how = (
                f"{check.symbolic} symbolic, {check.substituted} made from them, "
                f"{check.planned} planned"
            )
            print(f"{architecture:16s} {regime:8s} {same} ({seconds:.1f} s) {how}", flush=True)
            for line in check.notes:
                print(f"{'':26s}{line}", flush=True)
    order = {a: n for n, a in enumerate(ARCHITECTURES)}
    rows.sort(key=lambda r: (order.get(r["architecture"], len(order)), r["regime"]))
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0 if all(not r["differences"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
