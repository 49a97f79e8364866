"""Repeated layers copied against every layer run, on the zoo's diverse set of
architectures: for each architecture and regime, the step traced twice (``full_trace=True``
and the default) and held to each other op for op, the copied trace priced. Writes
``tests/data/copied_layers.json``, which tests/test_copied_layers.py reads (the live
comparison of all 29 x 3 steps takes about ten minutes here; the test reruns three).

``--plan fsdp=2`` (repeatable: ``--plan tp=2``) checks training steps across GPUs instead,
written to ``tests/data/copied_layers_<plan>.json``; an architecture the plan cannot run
is a row that says why.

    python examples/copied_layers_check.py [--out tests/data/copied_layers.json]
    python examples/copied_layers_check.py --plan fsdp=2
    python examples/copied_layers_check.py --plan tp=2
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
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plan", action="append", default=[], help="KEY=N, e.g. fsdp=2")
    args = parser.parse_args()
    plan = {}
    for given in args.plan:
        key, _, value = given.partition("=")
        if not value.isdigit():
            parser.error(f"--plan {given}: give KEY=N, e.g. fsdp=2")
        plan[key] = int(value)
    named = "_".join(f"{key}{value}" for key, value in plan.items())
    out = args.out or (OUT.with_name(f"copied_layers_{named}.json") if plan else OUT)
    rows = []
    for architecture in ARCHITECTURES:
        for regime in ("train",) if plan else REGIMES:
            start = time.perf_counter()
            try:
                check = replay_check(architecture, regime, plan=plan)
            except Exception as error:  # noqa: BLE001 - a plan this model cannot run: a row
                rows.append({"architecture": architecture, "regime": regime, "runs": False})
                rows[-1]["why"] = str(error).splitlines()[0]
                print(f"{architecture:16s} {regime:8s} cannot run: {rows[-1]['why']}")
                continue
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
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {out}")
    return 0 if all(not r.get("difference") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
