"""Inductor as referee: which kernels would torch.compile launch on a GPU, vs the fused policy?

For each reference case (torchroof/validation/referee_cases.py) this compiles the module with
Inductor
on the CPU under its GPU scheduling rules and stops before code generation
(torchroof/validation/referee.py), then traces the same module on meta and groups it with
torchroof's
``fused`` policy. Bytes are HBM bytes read + written, summed over kernels.

    python examples/inductor_reference.py                  # all cases, print the table
    python examples/inductor_reference.py --write          # ... and refresh the JSON reference
    python examples/inductor_reference.py --case llama_layer/bfloat16/fwd --kernels

``--write`` stores the Inductor side in examples/inductor_reference.json, which
tests/test_referee.py reads so that the tests need not recompile every case.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from torchroof.validation.gpu_rules import GPU_RULE_GAPS
from torchroof.validation.referee import InductorKernel, inductor_kernels, summary
from torchroof.validation.referee_cases import CASES, Case, torchroof_fused

JSON_PATH = Path(__file__).with_name("inductor_reference.json")
MB = 1e6


def inductor_side(case: Case) -> list[InductorKernel]:
    module, inputs = case.make("cpu")
    return inductor_kernels(module, inputs, backward=case.backward)


def case_record(case: Case, kernels: list[InductorKernel], seconds: float) -> dict[str, Any]:
    count, total = summary(kernels)
    record: dict[str, Any] = {
        "name": case.name,
        "dtype": case.dtype_name,
        "backward": case.backward,
        "note": case.note,
        "kernels": count,
        "bytes": total,
        "compile_s": round(seconds, 1),
    }
    record["per_phase"] = {
        phase: {"kernels": n, "bytes": b}
        for phase in ("forward", "backward")
        for n, b in [summary(kernels, phase)]
        if n
    }
    record["kernel_list"] = [k.to_dict() for k in kernels]
    return record


def print_kernels(key: str, inductor: list[InductorKernel], ours: list[Any]) -> None:
    print(f"\n== {key}")
    rows = [(k.phase[:3], k.kind, k.bytes_read, k.bytes_written, " ".join(k.ops)) for k in inductor]
    print(tabulate(rows, headers=("", "Inductor kernel", "read B", "written B", "ops")))
    rows = [
        (
            k.phase[:3],
            k.module,
            k.cost.bytes_read,
            k.cost.bytes_written,
            " ".join(op.packet.removeprefix("aten.") for op in k.ops),
        )
        for k in ours
    ]
    print(tabulate(rows, headers=("", "torchroof kernel", "read B", "written B", "ops")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {JSON_PATH.name}")
    parser.add_argument("--case", action="append", choices=list(CASES), help="only these")
    parser.add_argument("--kernels", action="store_true", help="list both sides' kernels")
    args = parser.parse_args()
    keys = args.case or list(CASES)
    # transformers' grouped_mm version checks are lru_cached: dynamo says so, harmlessly
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")

    start = time.perf_counter()
    records: dict[str, Any] = {}
    rows = []
    for key in keys:
        case = CASES[key]
        began = time.perf_counter()
        inductor = inductor_side(case)
        seconds = time.perf_counter() - began
        ours = torchroof_fused(case)
        records[key] = case_record(case, inductor, seconds)
        n_ind, b_ind = summary(inductor)
        b_ours = sum(k.cost.bytes for k in ours)
        rows.append(
            (
                case.name,
                case.dtype_name,
                case.phases,
                n_ind,
                len(ours),
                f"{b_ind / MB:.3f}",
                f"{b_ours / MB:.3f}",
                f"{b_ours / b_ind:.3f}" if b_ind else "-",
                f"{seconds:.1f}",
            )
        )
        if args.kernels:
            print_kernels(key, inductor, ours)
    print(
        tabulate(
            rows,
            headers=(
                "case",
                "dtype",
                "phases",
                "Inductor kernels",
                "torchroof kernels",
                "Inductor MB",
                "torchroof MB",
                "torchroof/Inductor",
                "compile s",
            ),
        )
    )
    if GPU_RULE_GAPS:
        print("GPU rules not applied (CPU rules used instead):", *GPU_RULE_GAPS, sep="\n  ")
    print(f"{len(keys)} cases in {time.perf_counter() - start:.1f} s")

    if args.write:
        previous = json.loads(JSON_PATH.read_text())["cases"] if JSON_PATH.exists() else {}
        document = {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "gpu_rule_gaps": list(GPU_RULE_GAPS),
            "cases": {
                k: records.get(k, previous.get(k)) for k in CASES if k in records or k in previous
            },
        }
        JSON_PATH.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {JSON_PATH}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
