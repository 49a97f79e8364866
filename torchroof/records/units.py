"""Byte counts as people read them (GiB)."""

GIB = 2**30


def gib(size: float) -> str:
    """Bytes as GiB, labelled: ``74.51 GiB``."""
    return f"{size / GIB:.2f} GiB"
