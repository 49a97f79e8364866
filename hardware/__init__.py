"""Accelerator and cluster specs: one TOML file per device or cluster, a source for every figure.

``get("h100")`` resolves aliases, accepts a path to a user's own TOML, and answers an
unknown name with the closest known names; ``get_cluster("dgx-h100")`` does the same for
clusters (``hardware/clusters/*.toml``).
"""

from torchroof.hardware.cluster import (
    LINK_LIMITS,
    ClusterSpec,
    ClusterSpecError,
    Link,
    UnknownClusterError,
    available_clusters,
    boundary_table,
    distinct_boundaries,
    get_cluster,
    is_cluster,
    load_cluster_file,
)
from torchroof.hardware.spec import (
    Boundary,
    Figure,
    HardwareSpec,
    HardwareSpecError,
    UnknownHardwareError,
    UnsupportedDtypeError,
    available,
    get,
    load_file,
    spec_dtype,
)
from torchroof.hardware.toml_checks import HardwareFigureWarning

__all__ = [
    "Boundary",
    "ClusterSpec",
    "ClusterSpecError",
    "Figure",
    "HardwareFigureWarning",
    "HardwareSpec",
    "HardwareSpecError",
    "Link",
    "UnknownClusterError",
    "UnknownHardwareError",
    "UnsupportedDtypeError",
    "available",
    "available_clusters",
    "LINK_LIMITS",
    "boundary_table",
    "distinct_boundaries",
    "get",
    "get_cluster",
    "is_cluster",
    "load_cluster_file",
    "load_file",
    "spec_dtype",
]
