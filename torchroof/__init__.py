"""torchroof: where the time of a step goes on accelerator X, traced on the meta device.

with torchroof.trace() as t:
    model(ids)
est = t.estimate(hardware="h100-sxm")
print(text.layer_table(est))     # from torchroof.render import text

An :class:`Estimate` (and a :class:`Comparison` or :class:`Sweep`) is data; torchroof.render
shows it:

- ``torchroof.render.text``: ``summary(est)``, ``layer_table(est, depth, collapse)``,
  ``kernel_table(est, top)``, ``comparison_table(a, b)``, ``coverage_line(est)``,
  ``estimate_label(est)``; ``variants_table(comparison)``, ``layer_deltas(comparison)``,
  ``sweep_table(sweep)``
- ``torchroof.render.files``: ``write(est, path)`` (the format from the suffix: JSON, CSV,
  Chrome trace, plots, HTML), ``estimate_json(est, path)``, ``write_csv(est, path)``,
  ``write_sweep(sweep, path)``, ``write_sweep_csv(sweep, path)``
- ``torchroof.render.html``: ``estimate_html(est, path)``, ``comparison_html(comparison,
  path)``, ``sweep_html(sweep, path)``

and ``Estimate.from_json(path)`` reads a saved estimate back.
"""

from torchroof.api import (
    ModelTraceError,
    PipelineTrace,
    Trace,
    estimate,
    estimate_trace,
    meta_copy,
    trace,
    trace_model,
    trace_module,
    trace_workload,
)
from torchroof.capture.budget import OpBudgetExceeded, op_budget
from torchroof.capture.mode import Capture
from torchroof.config import PricingOptions, Workload
from torchroof.planning import plan
from torchroof.prepared import PreparedModel, prepare
from torchroof.pricing.price import TracePlans
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta
from torchroof.report.compare import Comparison, Sweep
from torchroof.report.estimate import Estimate, KernelEstimate, LayerRow
from torchroof.serving import SequenceWork, ServeResult, StepTimer, serve
from torchroof.studies import compare, sweep

__version__ = "0.1.0"

__all__ = [
    "Capture",
    "Comparison",
    "Estimate",
    "KernelEstimate",
    "LayerRow",
    "ModelTraceError",
    "OpBudgetExceeded",
    "OpRecord",
    "PipelineTrace",
    "PreparedModel",
    "PricingOptions",
    "SequenceWork",
    "ServeResult",
    "StepTimer",
    "Sweep",
    "TensorMeta",
    "Trace",
    "TracePlans",
    "Workload",
    "compare",
    "estimate",
    "plan",
    "prepare",
    "serve",
    "estimate_trace",
    "meta_copy",
    "op_budget",
    "sweep",
    "trace",
    "trace_model",
    "trace_module",
    "trace_workload",
]
