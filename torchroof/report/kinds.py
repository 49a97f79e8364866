"""The words a kernel estimate's string fields take: the unit it runs on, the pipe that binds
it, the boundary whose term sets its time, its stream and the link a collective crosses."""

from __future__ import annotations

from typing import Literal

from torchroof.counters.cost import Unit
from torchroof.timing.streams import Stream

__all__ = ["Boundary", "KernelBound", "Link", "Stream", "Unit"]

# compute or memory at the HBM boundary (torchroof.timing.roofline); network for a collective
# whose link is the slower pipe
KernelBound = Literal["compute", "memory", "network"]
# the term of the hierarchical roofline that binds (torchroof.timing.roofline), or a
# collective's network; "" for a kernel that moves nothing
Boundary = Literal["", "compute", "hbm", "l2", "smem", "registers", "latency", "network"]
# the link a collective crosses (torchroof.timing.network): a cluster's intra-node kind, the
# network, both (hierarchical), none for a group of one; "" for a kernel that is no collective
Link = Literal["", "nvlink", "xgmi", "pcie", "network", "hierarchical", "none"]
