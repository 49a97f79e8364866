"""Settings, defined once: what step to trace (Workload and its parts), how to price it
(PricingOptions), the CLI flags generated from both, the limits of a trace, and the
error types. A leaf: it imports nothing of torchroof.

The Python API (``estimate``, ``trace_model``, ``estimate_trace``, ``compare``, ``sweep``),
the CLI (each flag's name, help, choices and default are generated from the fields) and
``compare --vary KEY=...`` all read these two dataclasses, so a knob added here reaches
every entry point. ``hardware`` (where the step runs) is the one other argument.

- :mod:`~torchroof.config.choices`: the names each choice knob takes, and the facts the
  checks read about them (which regimes train, which schedules split the backward, ...)
- :mod:`~torchroof.config.workload`: :class:`Workload`; :mod:`~torchroof.config.parts` and
  :mod:`~torchroof.config.parallel_layout`: its typed parts;
  :mod:`~torchroof.config.parallel_plan`: the mesh sizes (:class:`ParallelPlan`)
- :mod:`~torchroof.config.pricing`: :class:`PricingOptions`
- :mod:`~torchroof.config.flags`: ``knob()`` and the CLI flags generated from the fields;
  :mod:`~torchroof.config.knobs`: every knob by name
- :mod:`~torchroof.config.checks`, :mod:`~torchroof.config.limits`,
  :mod:`~torchroof.config.errors`: value checks, trace limits, error types
"""

from torchroof.config.choices import (
    DEFAULT_PP_SCHEDULE,
    DEFAULT_SEQ,
    DEFAULT_VIRTUAL_STAGES,
    KERNEL_TIMING_MODES,
    REGIMES,
    TIMING_MODES,
)
from torchroof.config.errors import OptionError, WorkloadError
from torchroof.config.flags import add_flags, flag_group, from_flags, value_type
from torchroof.config.knobs import PRICING_KNOBS, WORKLOAD_KNOBS, split_knobs
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.config.pricing import DEFAULT_ON_CHIP_BUDGET_BYTES, PricingOptions, parse_gemm_tile
from torchroof.config.workload import Workload

__all__ = [
    "DEFAULT_ON_CHIP_BUDGET_BYTES",
    "DEFAULT_PP_SCHEDULE",
    "DEFAULT_SEQ",
    "DEFAULT_VIRTUAL_STAGES",
    "PRICING_KNOBS",
    "REGIMES",
    "KERNEL_TIMING_MODES",
    "TIMING_MODES",
    "WORKLOAD_KNOBS",
    "OptionError",
    "ParallelPlan",
    "PricingOptions",
    "Workload",
    "WorkloadError",
    "add_flags",
    "flag_group",
    "from_flags",
    "parse_gemm_tile",
    "split_knobs",
    "value_type",
]
