"""The lab commands: ``roofline``, ``gemm``, ``fusion-bench`` and ``lab`` (IO bounds)."""

from __future__ import annotations

import argparse

from torchroof.cli.common import (
    DEFAULT_HARDWARE,
    Parser,
    Subparsers,
    check_plot,
    positive_int,
    wrote,
)


def add_parser(commands: Subparsers) -> None:
    """The four lab commands, in the order ``torchroof --help`` lists them."""
    add_roofline_parser(commands)
    add_gemm_parser(commands)
    add_fusion_bench_parser(commands)
    add_lab_parser(commands)


def add_roofline_parser(commands: Subparsers) -> None:
    """The ``roofline`` command: the roofline explorer."""
    roof = commands.add_parser(
        "roofline", help="roofline explorer: attainable FLOP/s at an intensity, at any boundary"
    )
    roof.add_argument("--hardware", default=DEFAULT_HARDWARE)
    roof.add_argument("--dtype", default="bf16")
    point = roof.add_mutually_exclusive_group(required=True)
    point.add_argument("--intensity", type=float, help="FLOP per byte crossing the boundary")
    point.add_argument("--preset", help="a common kernel's intensity (--preset list names them)")
    roof.add_argument(
        "--boundary",
        default="hbm",
        help="the boundary its bytes cross: registers, smem, l2, hbm, nvlink, pcie, network or "
        "<cluster>:<link> (default hbm)",
    )
    roof.add_argument(
        "--pipe", default=None, help="ceiling: a dtype's tensor core, fp32-fma, fp32-no-fma, sfu"
    )
    roof.add_argument("--plot", metavar="PATH", help="the roofline with the point (.png, .svg)")


def add_gemm_parser(commands: Subparsers) -> None:
    """The ``gemm`` command: the GEMM workbench."""
    gemm = commands.add_parser(
        "gemm", help="GEMM workbench: a tiled matmul's intensity and bound at each memory level"
    )
    gemm.add_argument("m", type=positive_int)
    gemm.add_argument("n", type=positive_int)
    gemm.add_argument("k", type=positive_int)
    gemm.add_argument("--dtype", default="bf16")
    gemm.add_argument("--tile", default="128", help="T (square) or T_mxT_n, e.g. 256x128")
    gemm.add_argument("--l2-absorption", type=float, default=0.85)
    gemm.add_argument("--hardware", default=DEFAULT_HARDWARE)
    gemm.add_argument(
        "--local-budget-kib",
        type=float,
        default=None,
        help="on-chip budget (> 0) for the tile fit check and CTAs per SM (default: the "
        "hardware's shared memory per SM)",
    )
    gemm.add_argument("--plot", metavar="PATH", help="the GEMM at every boundary (.png, .svg)")


def add_fusion_bench_parser(commands: Subparsers) -> None:
    """The ``fusion-bench`` command."""
    fuse = commands.add_parser(
        "fusion-bench", help="fusion bench: an elementwise chain, its kernel boundaries toggled"
    )
    fuse.add_argument("--tokens", type=positive_int, default=65536)
    fuse.add_argument("--d-model", type=positive_int, default=8192)
    fuse.add_argument("--dtype", default="bf16")
    fuse.add_argument("--hardware", default=DEFAULT_HARDWARE)
    fuse.add_argument(
        "--boundaries",
        default="split",
        help="5 digits, one per boundary after residual add, RMSNorm, scale, SiLU, multiply "
        "(1 = written to HBM); 'split' = 11111, 'fused' = 00000",
    )


def add_lab_parser(commands: Subparsers) -> None:
    """The ``lab`` command and its two IO-bound labs."""
    lab = commands.add_parser(
        "lab", help="IO bounds: flash attention's and chunked cross-entropy's bytes"
    )
    labs = lab.add_subparsers(dest="lab", parser_class=Parser, required=True)
    flash = labs.add_parser("flash", help="naive / tiled / compulsory attention intensity")
    flash.add_argument("--seq", type=positive_int, default=4096)
    flash.add_argument("--head-dim", type=positive_int, default=128)
    flash.add_argument("--block-rows", type=positive_int, default=128)
    flash.add_argument("--dtype", default="bf16")
    ce = labs.add_parser("cross-entropy", help="peak logits memory, materialised vs chunked")
    ce.add_argument("--tokens", type=positive_int, default=8192)
    ce.add_argument("--vocab", type=positive_int, default=100_000)
    ce.add_argument("--chunk", type=positive_int, default=1024)
    ce.add_argument("--d-model", type=positive_int, default=4096)
    ce.add_argument("--dtype", default="bf16")
    ce.add_argument("--hardware", default=DEFAULT_HARDWARE)


def run_roofline(args: argparse.Namespace) -> None:
    from torchroof.labs.explore import PRESETS, roofline_point

    if args.preset == "list":
        for name, preset in PRESETS.items():
            print(f"{name}: {preset.arithmetic} ({preset.seed})")
        return
    check_plot(args.plot)
    reading = roofline_point(
        args.hardware,
        args.dtype,
        args.intensity,
        boundary=args.boundary,
        pipe=args.pipe,
        preset=args.preset,
    )
    print("\n".join(reading.lines()))
    if args.plot:
        from torchroof.labs.plots import roofline_lab_plot

        wrote("roofline", str(roofline_lab_plot(reading, args.plot)))


def run_gemm(args: argparse.Namespace) -> None:
    from torchroof.labs.gemm_workbench import gemm_workbench

    check_plot(args.plot)
    reading = gemm_workbench(
        args.m,
        args.n,
        args.k,
        dtype=args.dtype,
        tile=args.tile,
        l2_absorption=args.l2_absorption,
        hardware=args.hardware,
        local_budget_bytes=(
            None if args.local_budget_kib is None else args.local_budget_kib * 1024
        ),
    )
    print("\n".join(reading.lines()))
    if args.plot:
        from torchroof.labs.plots import gemm_lab_plot

        wrote("GEMM roofline", str(gemm_lab_plot(reading, args.plot)))


def run_fusion_bench(args: argparse.Namespace) -> None:
    from torchroof.labs.fusion_bench import fusion_bench, parse_boundaries

    bench = fusion_bench(
        args.tokens, args.d_model, args.dtype, args.hardware, parse_boundaries(args.boundaries)
    )
    print("\n".join(bench.lines()))


def run_lab(args: argparse.Namespace) -> None:
    from torchroof.labs.io_bounds import (
        AttentionBounds,
        ChunkedCrossEntropy,
        attention_bounds,
        chunked_cross_entropy,
    )

    reading: AttentionBounds | ChunkedCrossEntropy
    if args.lab == "flash":
        reading = attention_bounds(args.seq, args.head_dim, args.block_rows, args.dtype)
    else:
        reading = chunked_cross_entropy(
            args.tokens,
            args.vocab,
            args.chunk,
            d_model=args.d_model,
            dtype=args.dtype,
            hardware=args.hardware,
        )
    print("\n".join(reading.lines()))
