"""Accelerator specs: one TOML file per device, a source for every figure.

``get("h100")`` resolves aliases, accepts a path to a user's own TOML, and answers an
unknown name with the closest known names.
"""

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
    "Figure",
    "HardwareSpec",
    "HardwareSpecError",
    "UnknownHardwareError",
    "UnsupportedDtypeError",
    "available",
    "get",
    "load_file",
    "spec_dtype",
]
