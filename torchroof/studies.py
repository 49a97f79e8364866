"""Many estimates of one model: variants side by side (:func:`compare`), sweeps over a
size (:func:`sweep`) and grids over several axes at once (:func:`sweep_grid`), each variant
checked before any is traced, and variants that differ only in pricing sharing one trace."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from torchroof.api import check_quant_hardware, estimate, estimate_trace, trace_model
from torchroof.collector import paused_gc
from torchroof.config import DEFAULT_SEQ, PRICING_KNOBS, WORKLOAD_KNOBS, Workload, value_type
from torchroof.models.sources import DEFAULT_MODEL, text_config
from torchroof.prepared import prepare
from torchroof.pricing.price import TracePlans
from torchroof.pricing.runtime import with_knobs, workload_defaults
from torchroof.progress import reporting
from torchroof.report.compare import Comparison, Grid, GridPoint, Sweep, SweepPoint, Variant

# The knobs, by name (torchroof/config/workload.py, pricing.py), plus where the step runs;
# every other key compare is given is a model-config field.
PRICING_KEYS = {"hardware", *PRICING_KNOBS}  # variants differing only in these share a trace
ESTIMATE_KEYS = {*WORKLOAD_KNOBS, *PRICING_KEYS}
_INT_KEYS = {f.name for f in fields(Workload) if value_type(f) is int}
# What a sweep may vary: every integer size of the step (batch, seq, context, tp, fsdp, dp,
# microbatches, ...), not the op budget.
SWEEP_KEYS = tuple(f.name for f in fields(Workload) if value_type(f) is int and f.name != "max_ops")
DEFAULT_SWEEP_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the CLI's --values
# What a grid may vary besides the sizes: where the step runs and how it is priced (points
# that differ only in these share one trace).
GRID_KEYS = (*SWEEP_KEYS, *sorted(PRICING_KEYS))
MAX_GRID_POINTS = 10_000
"""Points one grid may hold: each keeps its figures, and its estimate once asked for (a 70B
decode estimate is about 1 MB)."""
_PLAN_KEYS = ("tp", "fsdp", "dp", "ep", "cp", "pp")


def parse_value(key: str, text: str) -> Any:
    """A CLI value in the type the key takes: ints for sizes and most config fields,
    floats where they have a point, booleans for true/false, strings otherwise."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    if key in _INT_KEYS:
        raise ValueError(f"{key} takes integers, got {text!r}")
    try:
        return float(text)
    except ValueError:
        return text.strip()


def _with_config_fields(model: Any, fields: dict[str, Any]) -> Any:
    """The model's config with ``fields`` replaced (a copy; the original is untouched)."""
    from torchroof.models.sources import load_config

    if not fields:
        return model
    config = copy.deepcopy(load_config(model if not hasattr(model, "config") else model.config))
    for key, value in fields.items():
        if not hasattr(config, key):
            known = sorted(ESTIMATE_KEYS)
            raise ValueError(
                f"unknown key {key!r}: not an estimate argument ({', '.join(known)}) "
                f"nor a field of {type(config).__name__}"
            )
        _check_config_value(config, key, value)
        setattr(config, key, value)
    _check_heads(config)
    return config


def _check_config_value(config: Any, key: str, value: Any) -> None:
    """A config field varied to a value of another kind than the config holds (a count
    given as text), or a count that is not positive."""
    held = getattr(config, key)
    counts = isinstance(held, int) and not isinstance(held, bool)
    if counts and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{key} is a whole number in {type(config).__name__}, got {value!r}")
    if counts and held > 0 and value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value}")


def _check_heads(config: Any) -> None:
    """Attention heads a model can be built with: K/V heads that divide the query heads
    (grouped-query attention shares each K/V head among h / h_kv query heads), and a
    hidden size the query heads divide unless the config gives ``head_dim``."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return
    if isinstance(kv, int) and not isinstance(kv, bool) and (kv > heads or heads % kv):
        raise ValueError(
            f"num_key_value_heads={kv} must divide num_attention_heads={heads} (each K/V head "
            "serves a whole group of query heads)"
        )
    hidden = getattr(text, "hidden_size", None)
    if getattr(text, "head_dim", None) is None and isinstance(hidden, int) and hidden % heads:
        raise ValueError(
            f"hidden_size={hidden} does not divide into num_attention_heads={heads} heads"
        )


def check_variant(model: Any, settings: dict[str, Any], name: str) -> None:
    """Everything that refuses one variant before anything is traced, in a second at most:
    the knobs (:class:`~torchroof.config.Workload`, :class:`~torchroof.config.
    PricingOptions`), the hardware and a recipe it cannot run, the config fields varied
    (known, of the right kind, heads that divide), the tensor-parallel plan and the
    sequence against the model's maximum positions. The error keeps its type (a
    WorkloadError, an UnknownHardwareError, ...); its message starts with the variant
    (``variant num_key_value_heads=128: ...``)."""
    from torchroof.api import config_of, resolve_seq
    from torchroof.config import PricingOptions, split_knobs
    from torchroof.models.sources import check_layers, check_positions
    from torchroof.pricing.hardware import resolve_hardware
    from torchroof.pricing.runtime import check_runtime_regime
    from torchroof.workloads import regime
    from torchroof.workloads.parallel_step import check_plan

    try:
        config_fields = {k: v for k, v in settings.items() if k not in ESTIMATE_KEYS}
        knobs = {k: v for k, v in settings.items() if k in ESTIMATE_KEYS and k != "hardware"}
        workload_knobs, pricing_knobs = split_knobs(knobs)
        workload = Workload(**workload_knobs)
        pricing = PricingOptions(**pricing_knobs)
        check_runtime_regime(pricing, workload.regime)  # a runtime known, and this step's
        hardware = settings.get("hardware", "h100-sxm")
        resolve_hardware(hardware)
        check_quant_hardware(workload.quant, hardware)
        variant = _with_config_fields(model, config_fields)
        config = variant if config_fields else config_of(model)
        if config is None:  # a plain module: its inputs decide
            return
        workload, _ = resolve_seq(config, workload)
        label = str(model) if isinstance(model, (str, Path)) else type(model).__name__
        check_layers(config, name=label)
        check_plan(config, workload, name=label)
        length = regime(workload.regime).positions(workload)
        check_positions(config, length, workload.allow_beyond_max_positions, name=label)
    except (ValueError, KeyError) as error:
        if error.args and isinstance(error.args[0], str):
            error.args = (f"variant {name}: {error.args[0]}", *error.args[1:])
        raise


def compare(
    model: Any = DEFAULT_MODEL,
    vary: dict[str, Sequence[Any]] | None = None,
    *,
    hardware: Any = "h100-sxm",
    progress: bool = False,
    **base: Any,
) -> Comparison:
    """Estimate ``model`` once per value of each varied key (the others held at ``base``),
    as ``torchroof compare MODEL --vary KEY=V1,V2``.

    Keys are ``hardware``, any field of :class:`torchroof.config.Workload` or
    :class:`torchroof.config.PricingOptions` by its name, or a model-config field
    (``num_key_value_heads=[64, 8]``); ``base`` takes the same names as
    :func:`torchroof.estimate`. Every variant is checked before any is traced
    (:func:`check_variant`): a bad one fails in a second, named. ``progress=True`` shows
    on stderr which variant runs ("point 2 of 3") and each stage of it.
    """
    if not vary:
        raise ValueError("nothing to vary: give at least one key with its values")
    base = {"hardware": hardware, **base}
    variants: list[Variant] = []
    # variants that differ only in pricing share one trace, and those that share its
    # kernel policy too (another accelerator, timing mode, efficiency) its kernels
    traces: dict[str, tuple[Any, TracePlans]] = {}
    for key, values in vary.items():  # every variant is refused before any tracing
        if not values:
            raise ValueError(f"{key}: no values to compare")
        for value in values:
            check_variant(model, {**base, key: value}, f"{key}={value}")
    count = sum(len(values) for values in vary.values())
    with reporting(progress) as report:  # progress=True: "point 2 of 3" and each stage
        for key, values in vary.items():
            for value in values:
                report.point(len(variants) + 1, count, f"{key}={value}")
                settings = {**base, key: value}
                pricing = {k: v for k, v in settings.items() if k in PRICING_KEYS}
                tracing = {k: v for k, v in settings.items() if k not in PRICING_KEYS}
                # the runtime's workload defaults (torchtitan's reshard under a pipeline)
                knobs = {k: v for k, v in pricing.items() if k in PRICING_KNOBS}
                tracing = workload_defaults(with_knobs(None, knobs), tracing)
                cache_key = repr(sorted(tracing.items(), key=lambda kv: kv[0]))
                if cache_key not in traces:
                    traces[cache_key] = (_trace(model, tracing), TracePlans())
                trace, plans = traces[cache_key]
                est = estimate_trace(trace, plans=plans, **pricing)
                variants.append(Variant(f"{key}={value}", settings, est))
    return Comparison(variants)


def _trace(model: Any, tracing: dict[str, Any]) -> Any:
    fields = {k: v for k, v in tracing.items() if k not in ESTIMATE_KEYS}
    kwargs = {k: v for k, v in tracing.items() if k in ESTIMATE_KEYS}
    return trace_model(_with_config_fields(model, fields), **kwargs)


def sweep(
    model: Any = DEFAULT_MODEL,
    over: str = "batch",
    values: Sequence[int] = DEFAULT_SWEEP_VALUES,
    *,
    hardware: Any = "h100-sxm",
    progress: bool = False,
    **base: Any,
) -> Sweep:
    """Estimate ``model`` at each value of ``over``, one of :data:`SWEEP_KEYS` (batch, seq,
    context, the parallel sizes: ``fsdp`` over 8, 16, 32, 64 GPUs is a sweep over GPU
    counts), as ``torchroof sweep MODEL --over KEY --values V1,V2``; ``base`` takes the
    names :func:`torchroof.estimate` takes. Every point is checked before any is traced.
    ``progress=True`` shows on stderr which point runs and each stage of it."""
    if over not in SWEEP_KEYS:
        raise ValueError(f"sweep over one of {', '.join(SWEEP_KEYS)}, got {over!r}")
    if not values:
        raise ValueError("no values to sweep")
    base = {"hardware": hardware, **base}
    check_axis(over, base)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise ValueError(f"variant {over}={v!r}: {over} takes whole numbers")
    values = [int(v) for v in values]
    for v in values:
        check_variant(model, {**base, over: v}, f"{over}={v}")
    points = []
    with reporting(progress) as report:  # progress=True: "point 2 of 3" and each stage
        for index, v in enumerate(values, 1):
            report.point(index, len(values), f"{over}={v}")
            points.append(SweepPoint(v, estimate(model, **{**base, over: v})))
    return Sweep(over, points)


def sweep_grid(
    model: Any = DEFAULT_MODEL,
    axes: Mapping[str, Sequence[Any]] | None = None,
    *,
    hardware: Any = "h100-sxm",
    progress: bool = False,
    max_points: int = MAX_GRID_POINTS,
    **base: Any,
) -> Grid:
    """Estimate ``model`` at every combination of the ``axes`` values (``{"batch": [1, 8],
    "context": [1024, 8192]}``: four points), as ``torchroof sweep MODEL --over
    batch=1,8 --over context=1024,8192``. An axis is one of :data:`GRID_KEYS`: a size
    (batch, seq, context, tp, ...), ``hardware`` or a pricing option (``mode``, ...);
    ``base`` takes the names :func:`torchroof.estimate` takes. Each value of each axis is
    checked before anything is traced; a grid of more than ``max_points`` is refused. Points
    that differ only in hardware or pricing share one trace (:func:`torchroof.prepare`)."""
    grid_axes = _grid_axes(axes, max_points)
    base = {"hardware": hardware, **base}
    for key, _ in grid_axes:
        check_axis(key, base)
    for key, values in grid_axes:
        for value in values:
            check_variant(model, {**base, key: value}, f"{key}={value}")
    _check_clusters(grid_axes, base)
    workload_base = {k: v for k, v in base.items() if k not in PRICING_KEYS}
    prepared = prepare(model, **workload_base)
    combos = list(itertools.product(*(values for _, values in grid_axes)))
    keys = [key for key, _ in grid_axes]
    # the axes that change the trace outermost, so each step is traced once whatever the
    # pricing axes (the prepared model keeps only a few traces); the points keep their order
    tracing = [i for i, key in enumerate(keys) if key not in PRICING_KEYS]
    order = sorted(range(len(combos)), key=lambda n: [repr(combos[n][i]) for i in tracing])
    points: dict[int, GridPoint] = {}
    # progress=True: "point 2 of 300" and each stage; the collector paused over the whole
    # grid (its full collections would rescan every trace and plan the grid holds)
    with reporting(progress) as report, paused_gc():
        for done, n in enumerate(order, 1):
            at = dict(zip(keys, combos[n], strict=True))
            label = ", ".join(f"{k}={v}" for k, v in at.items())
            report.point(done, len(combos), label)
            settings = {**base, **at}
            where = settings.pop("hardware")
            priced = {k: v for k, v in settings.items() if k in PRICING_KEYS or k in at}
            with _named(label):
                metrics, made = prepared.figures(where, **priced)
            # an estimate made for the figures is kept; one not made is made when asked for
            points[n] = GridPoint(
                at, made, metrics=metrics, make=_maker(prepared, where, priced, label)
            )
    return Grid(
        [(key, list(values)) for key, values in grid_axes],
        [points[n] for n in range(len(combos))],
        notes=list(prepared.notes),
    )


@contextlib.contextmanager
def _named(label: str) -> Iterator[None]:
    """An error pricing a point says which point it is."""
    try:
        yield
    except (ValueError, KeyError) as error:
        if error.args and isinstance(error.args[0], str):
            error.args = (f"point {label}: {error.args[0]}", *error.args[1:])
        raise


def _maker(prepared: Any, where: Any, priced: dict[str, Any], label: str) -> Any:
    """The point's estimate, made when asked for (from the prepared model's traces)."""

    def make() -> Any:
        with _named(label):
            return prepared.price(where, **priced)

    return make


def _check_clusters(grid_axes: list[tuple[str, list[Any]]], base: dict[str, Any]) -> None:
    """A grid whose steps span GPUs (a parallel size above 1 on an axis or in ``base``) on
    an accelerator that is not a cluster, refused before tracing."""
    from torchroof.pricing.hardware import resolve_hardware

    axes = dict(grid_axes)
    spans = any(max(axes.get(k, [base.get(k) or 1])) > 1 for k in _PLAN_KEYS)
    if not spans:
        return
    for hardware in axes.get("hardware", [base["hardware"]]):
        if resolve_hardware(hardware)[1] is None:
            raise ValueError(
                f"hardware={hardware}: a point of this grid spans GPUs (a parallel size above "
                "1), which needs a cluster (dgx-h100, a cluster TOML)"
            )


def check_axis(key: str, base: dict[str, Any]) -> None:
    """Refuse a length the step does not read, which would give every point the same
    numbers (``context`` in a step whose length is ``seq``; ``seq`` in a step that reads its
    given ``context``): the regime's own positions are asked at two values."""
    from torchroof.workloads import regime

    if key not in ("seq", "context"):
        return
    knobs = {k: v for k, v in base.items() if k in WORKLOAD_KNOBS}
    step = regime(knobs.get("regime") or "prefill")
    seq = knobs.get("seq") or DEFAULT_SEQ
    lengths = {step.positions(Workload(**{**knobs, "seq": seq, key: n})) for n in (1024, 2048)}
    if len(lengths) == 1:
        raise ValueError(
            f"a {step.name} step does not read {key} (its length stays {lengths.pop()}): "
            "every point would be the same"
        )


def _grid_axes(
    axes: Mapping[str, Sequence[Any]] | None, max_points: int
) -> list[tuple[str, list[Any]]]:
    """The axes as (key, values), refused in one line: none, an unknown key, no values, a
    repeated value, a size that is not a whole number, or more points than ``max_points``."""
    if not axes:
        raise ValueError("nothing to sweep: give at least one axis with its values")
    out = []
    for key, values in axes.items():
        if key not in GRID_KEYS:
            raise ValueError(f"sweep over one of {', '.join(GRID_KEYS)}, got {key!r}")
        values = list(values)
        if not values:
            raise ValueError(f"{key}: no values to sweep")
        if key == "hardware" and not all(isinstance(v, (str, Path)) for v in values):
            raise ValueError("hardware: give accelerators and clusters by name or path")
        if key in SWEEP_KEYS:
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
                    raise ValueError(f"variant {key}={v!r}: {key} takes whole numbers")
            values = [int(v) for v in values]
        # 1 and 1.0 (or True and 1) are one value too: a point is found by its values
        if len({repr(v) for v in values}) != len(values) or any(
            a == b for i, a in enumerate(values) for b in values[i + 1 :]
        ):
            raise ValueError(f"{key}: a value is given twice")
        out.append((key, values))
    count = math.prod(len(values) for _, values in out)
    if count > max_points:
        raise ValueError(
            f"a grid of {count:,} points is more than max_points={max_points:,} (each point "
            "keeps its estimate): sweep fewer values, or split the grid"
        )
    return out
