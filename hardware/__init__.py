"""Accelerator and cluster specs: one TOML file per device or cluster, a source for every figure.

``get("h100")`` resolves aliases, accepts a path to a user's own TOML, and answers an
unknown name with the closest known names; ``get_cluster("dgx-h100")`` does the same for
clusters (``hardware/clusters/*.toml``).
"""

from torchroof.hardware.cluster import (
    ClusterSpec,
    ClusterSpecError,
    Link,
    UnknownClusterError,
    available_clusters,
    get_cluster,
    is_cluster,
    load_cluster_file,
)
from torchroof.hardware.spec import (
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

__all__ = [
    "ClusterSpec",
    "ClusterSpecError",
    "Figure",
    "HardwareSpec",
    "HardwareSpecError",
    "Link",
    "UnknownClusterError",
    "UnknownHardwareError",
    "UnsupportedDtypeError",
    "available",
    "available_clusters",
    "get",
    "get_cluster",
    "is_cluster",
    "load_cluster_file",
    "load_file",
    "spec_dtype",
]
