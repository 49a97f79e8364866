"""The regimes, by name: one module each, loaded when first asked for.

Adding a regime is one module exposing ``REGIME`` (a :class:`~torchroof.workloads.spec.Regime`),
one line in :data:`REGIME_MODULES`, and the facts ``Workload``'s checks read in
:data:`torchroof.config.choices.REGIME_FACTS` (the CLI's ``--regime`` choices); looking a
regime up holds the two to the same facts. ``compare --vary regime=...`` and the report read
it from here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from torchroof import progress
from torchroof.config.choices import DEFAULT_SEQ, REGIME_FACTS, REGIMES
from torchroof.config.errors import WorkloadError
from torchroof.parallel.quantised_shards import quantize_shards
from torchroof.parallel.stages import record_stage, release_stage
from torchroof.quant.recipes import ABSORBED_MLA_WIDE, Quantised, quantize_model
from torchroof.records.trace import Trace
from torchroof.workloads.parallel_step import describe, parallel_program
from torchroof.workloads.repeated import replayed
from torchroof.workloads.spec import TARGET, Regime

if TYPE_CHECKING:
    from torchroof.config import Workload

REGIME_MODULES: dict[str, str] = {
    "prefill": "torchroof.workloads.prefill",
    "decode": "torchroof.workloads.decode",
    "train": "torchroof.workloads.train",
}
assert REGIMES == tuple(REGIME_MODULES), "torchroof.config.choices.REGIMES lists the regimes"


def regime(name: str) -> Regime:
    """The regime called ``name``; a :class:`WorkloadError` listing the known ones."""
    if name not in REGIME_MODULES:
        known = ", ".join(REGIME_MODULES)
        raise WorkloadError(f"unknown regime {name!r}; choose one of {known}")
    found = importlib.import_module(REGIME_MODULES[name]).REGIME
    assert found.name == name, f"{REGIME_MODULES[name]} declares {found.name!r}, not {name!r}"
    facts = REGIME_FACTS[name]
    assert (found.trains, found.knobs) == (facts.trains, facts.knobs), (
        f"{REGIME_MODULES[name]} and torchroof.config.choices.REGIME_FACTS disagree on {name!r}"
    )
    return found


def compute_dtype(workload: Workload) -> torch.dtype:
    """The dtype the model's weights and activations are built in for this workload."""
    return regime(workload.regime).compute_dtype(workload)


def run_workload(
    models: torch.nn.Module | Mapping[str, torch.nn.Module], workload: Workload
) -> Trace:
    """Trace one step of ``workload`` on ``models`` (on meta): one module, or modules keyed by
    the roles the regime runs (``{"target": ..., "draft": ...}``)."""
    if workload.seq is None:  # left out, with no model config to shorten it against
        workload = dataclasses.replace(workload, seq=DEFAULT_SEQ)
    step = regime(workload.regime)
    given = {TARGET: models} if isinstance(models, torch.nn.Module) else dict(models)
    missing = [role for role in step.roles if role not in given]
    extra = [role for role in given if role not in step.roles]
    if missing or extra:
        raise WorkloadError(
            f"the {step.name} regime runs the models {', '.join(step.roles)}; "
            f"given {', '.join(given) or 'none'}"
        )
    # absorbed latent attention reads kv_b_proj's weight directly (torchroof/models/mla.py)
    absorbs = "mla" in step.knobs and workload.mla == "absorbed"
    wide = ABSORBED_MLA_WIDE if absorbs else ()
    report = progress.current()
    if workload.quant != "none":
        report.begin(f"applying the {workload.quant} quantisation recipe")
    # a serving recipe under tensor or expert parallel quantises each rank's shards, once
    # sharded
    shards = (workload.tp > 1 or workload.ep > 1) and not step.trains and workload.quant != "none"
    found: list[Quantised] = []

    def quantise_shards(model: torch.nn.Module) -> None:
        found.append(quantize_shards(model, workload.quant, wide))

    if not shards:
        found.append(quantize_model(given[TARGET], workload.quant, step.trains, wide))
    # rank 0 of the plan; on one GPU the model as it is
    plan = describe(workload.plan.given_mesh)  # as given: dp under ZeRO
    if plan:  # ends when the first traced op begins the next stage
        report.begin(f"setting up rank 0 of {plan}")
    after = quantise_shards if shards else None
    try:
        with (
            parallel_program(given[TARGET], workload, after),
            replayed(given, workload) as replays,
        ):
            trace = step.trace(given, workload)
        trace.facts.repeated_layers = replays.describe(trace)
        record_stage(given[TARGET], trace)
    finally:
        release_stage(given[TARGET])  # traced or failed: its graph would hold its model
    quantised = found[0]
    note = getattr(given[TARGET], "torchroof_build_note", None)
    if note:
        trace.facts.build_note = note
    trace.facts.quant = quantised.describe()
    trace.facts.workload = workload
    trace.facts.tokens = step.tokens(workload)
    return trace
