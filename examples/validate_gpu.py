"""Calibrate an accelerator and set torchroof's predictions beside measured runs on it.

Cases (issue: fidelity, GPU path): (a) GEMMs over the seed's Table 2 shapes, (b) the seed's
Table 3 elementwise ops at a size far above L2, (c) flash attention at N = 1024 … 16384,
(d) a Llama-style model for prefill, decode (batch 1 and 64, context 8192) and a training
step. Every case is predicted twice: with the datasheet spec and with the ceilings measured
here. Results go to examples/validation/<device>.json (and the measured TOML beside it).

    python examples/validate_gpu.py --device cuda --hardware h200-sxm
    python examples/validate_gpu.py --device cpu     # smoke test at tiny sizes, in a temp folder
    python examples/validate_gpu.py --device cpu --out examples/validation   # refresh it
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate

import torchroof
from torchroof.calibrate import calibrate, time_op
from torchroof.validate import TINY_OVERRIDES, validate

OUT = Path(__file__).resolve().parent / "validation"


def _cases(device: str, small: bool) -> list[tuple[str, Callable[[], Any]]]:
    """(label, step) pairs; every step runs real kernels on ``device``."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cases: list[tuple[str, Callable[[], Any]]] = []
    d = 1024 if small else 8192
    for tokens in (32768, 512, 64, 1):  # seed 000 Table 2: a d x d projection
        m = max(1, tokens // 32) if small else tokens
        x = torch.randn(m, d, device=device, dtype=dtype)
        w = torch.randn(d, d, device=device, dtype=dtype)
        cases.append((f"gemm M={m} d={d}", lambda x=x, w=w: torch.mm(x, w)))
    n = 2**22 if small else 2**28  # Table 3 at a size far above L2
    a = torch.randn(n // 4096, 4096, device=device, dtype=dtype)
    b = torch.randn_like(a)
    weight = torch.ones(4096, device=device, dtype=dtype)
    cases += [
        ("cast bf16->fp32", lambda: a.float()),
        ("residual add", lambda: a + b),
        ("rmsnorm (fused op)", lambda: F.rms_norm(a, (4096,), weight)),
        ("softmax", lambda: torch.softmax(a, -1)),
        ("gelu tanh", lambda: F.gelu(a, approximate="tanh")),
        ("swiglu (silu * up)", lambda: F.silu(a) * b),
    ]
    heads, head_dim = (4, 64) if small else (32, 128)
    for length in (256, 512) if small else (1024, 2048, 4096, 8192, 16384):
        q = torch.randn(1, heads, length, head_dim, device=device, dtype=dtype)
        cases.append(
            (
                f"flash attention N={length} causal",
                lambda q=q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
            )
        )
    return cases


def _predict(step: Callable[[], Any], spec: Any, overhead: float) -> float:
    with torch.no_grad(), torchroof.trace() as recorded:
        step()
    return torchroof.estimate_trace(
        recorded, spec, fusion="eager", launch_overhead_s=overhead
    ).time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hardware", default="h200-sxm", help="datasheet spec to compare")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder for the JSON and TOML (default: {OUT} on a GPU; a new temporary folder "
        "for the CPU smoke run, so the checked-in smoke files are only replaced on purpose)",
    )
    args = parser.parse_args()
    small = args.device == "cpu"
    out_dir = args.out or (Path(tempfile.mkdtemp(prefix="torchroof-smoke-")) if small else OUT)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "cpu-smoke" if small else args.device.replace(":", "-")

    print(f"calibrating {args.device} ...")
    measured = calibrate(
        args.device,
        progress=lambda m: print(f"  {m}"),
        stream_bytes=64 * 2**20 if small else None,
        matmul_sizes=(512,) if small else None,
    )
    print("\n".join(measured.lines()))
    toml = out_dir / f"{tag}.toml"
    toml.write_text(measured.to_toml(f"{tag}-measured"))
    datasheet = torchroof.hardware.get(args.hardware) if not small else None
    calibrated = torchroof.hardware.get(str(toml))
    overhead = measured.launch_overhead_s

    rows, results = [], []
    with torch.no_grad():
        for label, step in _cases(args.device, small):
            seconds = time_op(step, args.device, repeats=5, inner=1 if small else 10)
            cal = _predict(step, calibrated, overhead)
            spec = _predict(step, datasheet, 0.0) if datasheet else None
            results.append(
                {
                    "case": label,
                    "measured_s": seconds,
                    "predicted_calibrated_s": cal,
                    "predicted_spec_s": spec,
                }
            )
            rows.append(
                [
                    label,
                    f"{seconds * 1e6:.1f}",
                    f"{cal * 1e6:.1f}",
                    f"{cal / seconds:.2f}",
                    f"{spec / seconds:.2f}" if spec else "-",
                ]
            )

    overrides = dict(TINY_OVERRIDES) if small else {}
    model_runs = [
        ("prefill", 1, 256 if small else 4096),
        ("decode", 1, 256 if small else 8192),
        ("decode", 8 if small else 64, 256 if small else 8192),
        ("train", 1, 128 if small else 2048),
    ]
    for regime, batch, seq in model_runs:
        for label_hw, hw in (
            ("calibrated", str(toml)),
            ("spec", args.hardware if not small else None),
        ):
            if hw is None:
                continue
            result = validate(
                args.model,
                regime,
                device=args.device,
                hardware=hw,
                batch=batch,
                seq=seq,
                overrides=overrides,
                launch_overhead_s=overhead,
            )
            label = (
                f"{args.model} {regime} b={batch} {'ctx' if regime == 'decode' else 'seq'}={seq}"
            )
            results.append({"case": label, "hardware": label_hw, **result.to_dict()})
            rows.append(
                [
                    f"{label} [{label_hw}]",
                    f"{result.measured_total_s * 1e6:.1f}",
                    f"{result.predicted_total_s * 1e6:.1f}",
                    f"{result.total_ratio:.2f}",
                    "",
                ]
            )
    print(
        tabulate(
            rows,
            headers=[
                "case",
                "measured us",
                "predicted us (calibrated)",
                "pred/meas (calibrated)",
                "pred/meas (spec)",
            ],
            disable_numparse=True,
        )
    )
    out = out_dir / f"{tag}.json"
    out.write_text(
        json.dumps(
            {"device": measured.to_dict(), "spec": args.hardware, "cases": results}, indent=1
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
