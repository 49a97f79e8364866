"""What a training plan search costs, against one ``torchroof estimate`` of one plan of the
same model measured in this run (the target: searching 1,000 plans of Llama-3-70B on 256
H100s within 20x one estimate).

Each measurement runs in its own process, imports warm:

- ``estimate``: one ``torchroof.estimate`` of FSDP 32 x TP 8 (sequence parallel), 256
  sequences of 8,192 tokens a step (1 x 8 micro-batches a data rank), on a DGX H100
  cluster, measured before the searches and after them: their mean is the reference;
- ``space``: the whole space enumerated and its memory floors taken (nothing traced);
- ``search``: ``torchroof.plan`` over a narrowed space (``--tp``, ``--pp`` (no pipeline
  unless given), ``--cp`` (1), sequence parallel, every recompute choice, every split of
  the data ranks (DDP with the ``--zero`` stages, 0), micro-batches of 1 sequence up to
  ``--max-micro-batch`` (1)): each layout priced from copies of the model with
  2 and 3 layers (a stage, where its pipeline's stages hold 8 layers or more, or 4 under
  interleaved 1F1B whose ranks hold 8; the others whole; 1F1B and interleaved pipelines of
  the same ranks trace their stages once, and pipelines of several sizes over replicas of
  the same shards carry them to their own replicas), then the best priced at full depth
  (timed apart);
- ``whole`` (with ``--whole``): the same search with every layout priced at full depth,
  as each was before copies (about an estimate a layout: tens of minutes);
- ``third-each`` (with ``--third-each``, in one process): the same search with the 3-layer
  copy of each layout holding its own third micro-batch to its second, as before it
  trusted the 2-layer copy's (``torchroof.workloads.microbatches.held_once``).

    python examples/benchmark_plan.py [--model llama-3-70b --gpus 256 --seq 8192
        --global-batch 256] [--tp 8] [--pp 1] [--cp 1] [--zero 0] [--max-micro-batch 1]
        [--jobs 1] [--whole] [--third-each]

A search of more than 1,000 plans (1,020 past the memory floor, all from copies):
``--tp 4 8 --pp 1 2 4 8 --cp 1 2 --zero 0 1 2 --max-micro-batch 2``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PLAN = {"tp": 8, "sequence_parallel": True, "fsdp": 32, "batch": 1, "microbatches": 8}


def _child(kind: str, args: argparse.Namespace) -> None:
    import torchroof
    from torchroof.api import config_of
    from torchroof.planning.memory_floor import layer_parameters, memory_floor
    from torchroof.planning.space import TrainingSpace, enumerate_training
    from torchroof.planning.workers import PricingJob, price_layout
    from torchroof.pricing.hardware import resolve_hardware

    start = time.perf_counter()
    if kind == "estimate":
        torchroof.estimate(args.model, "train", hardware=args.hardware, seq=args.seq, **PLAN)
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return
    if kind == "space":
        config = config_of(args.model)
        space = TrainingSpace(gpus=args.gpus, seq=args.seq, global_batch=args.global_batch)
        found = enumerate_training(config, space)
        counts = layer_parameters(config)
        spec, _ = resolve_hardware(args.hardware)
        capacity = spec.hbm_capacity_bytes.value if spec.hbm_capacity_bytes else float("inf")
        fits = sum(memory_floor(layout, counts) <= capacity for layout in found.layouts)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "layouts": len(found.layouts), "kept": fits}))
        return
    narrowed = {
        "tp": tuple(args.tp),
        "pp": tuple(args.pp),
        "cp": tuple(args.cp),
        "sequence_parallel": (True,),
        "zero": tuple(args.zero),
        "max_micro_batch": args.max_micro_batch,
    }
    whole = kind == "whole"
    if kind == "third-each":  # this process prices every layout (--jobs 1)
        import contextlib

        import torchroof.planning.shallow

        torchroof.planning.shallow.held_once = contextlib.nullcontext  # type: ignore[assignment]
    plans = torchroof.plan(
        args.model,
        gpus=args.gpus,
        hardware=args.hardware,
        seq=args.seq,
        global_batch=args.global_batch,
        space=narrowed,
        jobs=args.jobs,
        max_plans=100_000,
        shallow=not whole,
        confirm=0,  # the best priced at full depth below, timed apart
    )
    seconds = time.perf_counter() - start
    count = len(plans.ranked) + len(plans.over_memory) + sum(plans.failed.values())
    carried = plans.to_dict()["carried"]
    start = time.perf_counter()
    best = plans.best
    full_step_s = best.step_time_s
    if best.carried:  # the best priced again at full depth, as the search's confirm does
        job = PricingJob(args.model, best.layout, args.seq, args.hardware, {}, None, {})
        priced = price_layout(job)
        assert not isinstance(priced, str), priced
        full_step_s = priced["step_time_s"]
    confirm = time.perf_counter() - start
    print(
        json.dumps(
            {
                "seconds": seconds,
                "confirm": confirm,
                "priced": count,
                "carried": carried,
                "best": best.layout.label(),
                "best_step_s": best.step_time_s,
                "full_step_s": full_step_s,
                "confirm_carried": best.carried,
            }
        )
    )


def _run(kind: str, argv: list[str]) -> dict:
    command = [sys.executable, __file__, "--child", kind, *argv]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--hardware", default="dgx-h100")
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[8])
    parser.add_argument("--pp", type=int, nargs="+", default=[1], help="pipeline sizes searched")
    parser.add_argument("--cp", type=int, nargs="+", default=[1], help="context sizes searched")
    parser.add_argument("--zero", type=int, nargs="+", default=[0], help="ZeRO stages of DDP")
    parser.add_argument("--max-micro-batch", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--whole", action="store_true", help="also search at full depth")
    parser.add_argument(
        "--third-each",
        action="store_true",
        help="also search with each copy holding its own third micro-batch (--jobs 1)",
    )
    parser.add_argument("--child", choices=["estimate", "space", "search", "whole", "third-each"])
    args = parser.parse_args()
    if args.third_each and args.jobs != 1:
        parser.error("--third-each measures the search in one process: give --jobs 1")
    if args.child:
        _child(args.child, args)
        return
    argv = sys.argv[1:]
    before = _run("estimate", argv)["seconds"]
    space = _run("space", argv)
    search = _run("search", argv)
    whole = _run("whole", argv) if args.whole else None
    third_each = _run("third-each", argv) if args.third_each else None
    after = _run("estimate", argv)["seconds"]
    reference = (before + after) / 2  # an estimate's time moves by tens of percent here
    print(
        f"one estimate of one plan: {reference:.2f} s (the reference: the mean of one before "
        f"the searches, {before:.2f} s, and one after, {after:.2f} s)"
    )
    print(
        f"the whole space: {space['layouts']:,} layouts, {space['kept']:,} past the memory "
        f"floor, enumerated in {space['seconds']:.2f} s ({space['seconds'] / reference:.2f}x)"
    )
    per_plan = search["seconds"] / search["priced"]
    total = search["seconds"] + search["confirm"]
    best = f"the best, {search['best']}, {search['best_step_s']:.6f} s a step" + (
        f" carried, {search['full_step_s']:.6f} s priced again at full depth in "
        f"{search['confirm']:.1f} s"
        if search["confirm_carried"]
        else " (priced whole)"
    )
    print(
        f"a narrowed search: {search['priced']} plans priced ({search['carried']} from copies "
        f"of 2 and 3 layers (a stage, where pipelined), the others whole) in "
        f"{search['seconds']:.1f} s "
        f"({per_plan:.2f} s a plan, {per_plan / reference:.3f}x the estimate); {best}: "
        f"{total:.1f} s in all ({total / reference:.1f}x the estimate)"
    )
    if search["priced"] >= 1000:
        print(
            f"this search of {search['priced']:,} plans and its best at full depth: "
            f"{total / reference:,.1f}x the estimate, measured (the aim is 20x for 1,000)"
        )
    thousand = 1000 * per_plan + search["confirm"]
    print(
        f"1,000 such plans and the best at full depth, at that rate: about "
        f"{thousand / reference:,.0f}x the estimate (the aim is 20x)"
    )
    if third_each is not None:
        same = all(third_each[k] == search[k] for k in ("best", "best_step_s", "priced"))
        print(
            f"the same search with each copy holding its own third micro-batch: "
            f"{third_each['seconds']:.1f} s for {third_each['priced']} plans (the search "
            f"above took {search['seconds'] / third_each['seconds']:.2f}x that); best "
            f"{third_each['best']}, {third_each['best_step_s']:.6f} s a step ("
            + ("the same" if same else "NOT the same")
            + " best, step time and plan count as the search above)"
        )
    if whole is not None:
        print(
            f"the same search at full depth: {whole['seconds']:.1f} s "
            f"({whole['seconds'] / whole['priced'] / reference:.2f}x the estimate a plan; "
            f"{whole['seconds'] / search['seconds']:.1f}x the copies' search); best "
            f"{whole['best']}, {whole['best_step_s']:.4f} s a step"
        )


if __name__ == "__main__":
    main()
