"""Calibrate an accelerator and set torchroof's predictions beside measured runs on it.

Cases (the GPU path): (a) GEMMs over the prefill and decode projection shapes, (b) the
elementwise ops at a size far above L2, (c) flash attention at N = 1024 … 16384,
(d) a Llama-style model for prefill, decode (batch 1 and 64, context 8192) and a training
step. Every case is predicted against the ceilings measured here and (on a GPU) against the
datasheet spec, each in both timing modes, priced the same way for an op and for a model
step so every row's columns compare: the pure roofline (a floor: no launch, no waves) and
the realistic mode, which adds the launch the hardware file lists (the calibrated file's is
the one measured here) and, where the file has SMs and on-chip rates, waves, on-chip roofs,
the latency shelf and the achievable fractions. A model step's ratio is the median of its
repeats' ratios (torchroof.validation.validate). Results go to examples/validation/<device>.json
(and
the measured TOML beside it).

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
from torchroof.config import KERNEL_TIMING_MODES
from torchroof.validation.calibrate import calibrate, time_op
from torchroof.validation.validate import TINY_OVERRIDES, validate

OUT = Path(__file__).resolve().parent / "validation"


def _cases(device: str, small: bool) -> list[tuple[str, Callable[[], Any]]]:
    """(label, step) pairs; every step runs real kernels on ``device``."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cases: list[tuple[str, Callable[[], Any]]] = []
    d = 1024 if small else 8192
    for tokens in (32768, 512, 64, 1):  # a d x d projection, prefill down to decode
        m = max(1, tokens // 32) if small else tokens
        x = torch.randn(m, d, device=device, dtype=dtype)
        w = torch.randn(d, d, device=device, dtype=dtype)
        cases.append((f"gemm M={m} d={d}", lambda x=x, w=w: torch.mm(x, w)))
    n = 2**22 if small else 2**28  # the elementwise ops at a size far above L2
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


def _predict(step: Callable[[], Any], spec: Any) -> dict[str, float]:
    """The step's predicted time in each timing mode (pure roofline, realistic)."""
    with torch.no_grad(), torchroof.trace() as recorded:
        step()
    return {
        mode: torchroof.estimate_trace(recorded, spec, fusion="eager", mode=mode).time_s
        for mode in KERNEL_TIMING_MODES
    }


def _row(case: str, hardware: str, measured_s: float, predicted: dict[str, float]) -> list[str]:
    return [
        case,
        hardware,
        f"{measured_s * 1e6:.1f}",
        *(f"{predicted[mode] * 1e6:.1f}" for mode in KERNEL_TIMING_MODES),
        *(f"{predicted[mode] / measured_s:.2f}" for mode in KERNEL_TIMING_MODES),
    ]


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
    specs = {"calibrated": torchroof.hardware.get(str(toml))}
    if not small:
        specs["spec"] = torchroof.hardware.get(args.hardware)

    rows, results = [], []
    with torch.no_grad():
        for label, step in _cases(args.device, small):
            seconds = time_op(step, args.device, repeats=5, inner=1 if small else 10)
            for label_hw, spec in specs.items():
                predicted = _predict(step, spec)
                results.append(
                    {
                        "case": label,
                        "hardware": label_hw,
                        "measured_s": seconds,
                        "predicted_s": predicted,
                    }
                )
                rows.append(_row(label, label_hw, seconds, predicted))

    overrides = dict(TINY_OVERRIDES) if small else {}
    model_runs = [
        ("prefill", 1, 256 if small else 4096),
        ("decode", 1, 256 if small else 8192),
        ("decode", 8 if small else 64, 256 if small else 8192),
        ("train", 1, 128 if small else 2048),
    ]
    for regime, batch, seq in model_runs:
        for label_hw, spec in specs.items():
            # the launch is the file's own, as for the op cases above
            result = validate(
                args.model,
                regime,
                device=args.device,
                hardware=spec,
                batch=batch,
                seq=seq,
                overrides=overrides,
            )
            label = (
                f"{args.model} {regime} b={batch} {'ctx' if regime == 'decode' else 'seq'}={seq}"
            )
            results.append({"case": label, "hardware": label_hw, **result.to_dict()})
            rows.append(
                [
                    label,
                    label_hw,
                    f"{result.measured_total_s * 1e6:.1f}",
                    *(f"{result.predicted(mode).median * 1e6:.1f}" for mode in KERNEL_TIMING_MODES),
                    *(f"{result.ratio(mode).median:.2f}" for mode in KERNEL_TIMING_MODES),
                ]
            )
    print(
        tabulate(
            rows,
            headers=[
                "case",
                "ceilings",
                "measured us",
                *(f"{mode} us" for mode in KERNEL_TIMING_MODES),
                *(f"pred/meas {mode}" for mode in KERNEL_TIMING_MODES),
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
