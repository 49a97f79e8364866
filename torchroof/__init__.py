"""torchroof: where the time of a step goes on accelerator X, traced on the meta device.

with torchroof.trace() as t:
    model(ids)
est = t.estimate(hardware="h100-sxm")
print(est.table())
"""

from torchroof.api import (
    ModelTraceError,
    PipelineTrace,
    Trace,
    estimate,
    meta_copy,
    trace,
    trace_model,
    trace_module,
    trace_workload,
)
from torchroof.capture.mode import Capture, OpBudgetExceeded, op_budget
from torchroof.config.options import PricingOptions, Workload
from torchroof.pricing.price import estimate_trace
from torchroof.records.trace import OpRecord, TensorMeta
from torchroof.report.compare import Comparison, Sweep, compare, sweep
from torchroof.report.estimate import Estimate, KernelEstimate, LayerRow

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
    "PricingOptions",
    "Sweep",
    "TensorMeta",
    "Trace",
    "Workload",
    "compare",
    "estimate",
    "estimate_trace",
    "meta_copy",
    "op_budget",
    "sweep",
    "trace",
    "trace_model",
    "trace_module",
    "trace_workload",
]
