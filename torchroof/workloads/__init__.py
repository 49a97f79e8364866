"""Drive a model through one step under capture: a regime per module (prefill, decode,
train), found by name in :mod:`torchroof.workloads.registry`.

One path for every regime, and no per-regime formula sheet: the real model runs
on meta, and only what meta cannot do is supplied here: a KV cache built directly at
context N, optimizer state allocated before the traced step, and the fused optimizer
kernel a GPU would launch.
"""

from torchroof.workloads.inputs import kv_bytes_per_token, kv_shape, token_ids
from torchroof.workloads.registry import REGIMES, compute_dtype, regime, run_workload
from torchroof.workloads.spec import TARGET, Regime

__all__ = [
    "REGIMES",
    "TARGET",
    "Regime",
    "compute_dtype",
    "kv_bytes_per_token",
    "kv_shape",
    "regime",
    "run_workload",
    "token_ids",
]
