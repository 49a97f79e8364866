"""The collective kinds and their nccl-tests bus factors: bytes a rank sends per byte of message.

Message size ``S`` and each factor are defined once, in torchroof.timing.network's docstring;
they live here, below timing, so the cost rules (counters.collectives) can count wire bytes.
"""

from __future__ import annotations

COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send_recv",
)


def check_kind(kind: str) -> None:
    """Refuse a collective kind that is not one of COLLECTIVE_KINDS."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r} (known: {', '.join(COLLECTIVE_KINDS)})")


def bus_factor(kind: str, group_size: int) -> float:
    """Bytes a rank sends on the wire per byte of message (nccl-tests bus bandwidth factor;
    the definitions of S and of each factor are in torchroof.timing.network's docstring)."""
    check_kind(kind)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    n = group_size
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, send_recv
