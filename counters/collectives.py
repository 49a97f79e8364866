"""Collectives: W = 0, the HBM bytes each rank reads and writes, and its bytes on the wire.

The roofline at the network boundary (docs/concepts/network-ridges.md): a collective does no
arithmetic; its cost is bytes, twice over.
Across HBM a rank reads what it sends and writes what it receives (Q, priced here as for
any op, unit ``network``); across the link it sends ``wire_bytes(op)`` = message size S x
the nccl-tests bus factor of its kind and group size (torchroof.counters.bus.bus_factor; S
and each factor are defined once in torchroof.timing.network). The group's size and global
ranks are recorded by capture on every collective (``group_size``, ``group_ranks``).

``wait_tensor`` and ``_wrap_tensor_autograd`` move nothing: the first marks where a rank
waits for a collective's result, the second hands the result to autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torchroof.counters.bus import bus_factor
from torchroof.counters.cost import ZERO, Cost
from torchroof.counters.registry import register
from torchroof.counters.tensors import compute_dtype, distinct, refs_of, tensor_key

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta


@dataclass(frozen=True)
class CollectiveSchema:
    """Which arguments of one collective packet the rank sends and receives.

    ``sends``: the schema arguments read (and sent). ``receives``: the arguments written in
    place, or ``None`` when the op returns what it received (the functional ops).
    ``message``: the side that is nccl-tests' S (the gathered output of an all-gather,
    the full input of a reduce-scatter, the buffer of the others).
    """

    kind: str  # a torchroof.counters.bus.COLLECTIVE_KINDS entry
    sends: tuple[str, ...]
    receives: tuple[str, ...] | None
    message: Literal["sends", "receives"]


def _functional(kind: str, sends: str, message: Literal["sends", "receives"]) -> CollectiveSchema:
    return CollectiveSchema(kind, (sends,), None, message)


_FUNCTIONAL = {
    "all_reduce": _functional("all_reduce", "input", "sends"),
    "all_reduce_": CollectiveSchema("all_reduce", ("input",), ("input",), "sends"),
    "all_reduce_coalesced": _functional("all_reduce", "inputs", "sends"),
    "all_reduce_coalesced_": CollectiveSchema("all_reduce", ("inputs",), ("inputs",), "sends"),
    "all_gather_into_tensor": _functional("all_gather", "input", "receives"),
    "all_gather_into_tensor_out": _functional("all_gather", "input", "receives"),
    "all_gather_into_tensor_coalesced": _functional("all_gather", "inputs", "receives"),
    "reduce_scatter_tensor": _functional("reduce_scatter", "input", "sends"),
    "reduce_scatter_tensor_out": _functional("reduce_scatter", "input", "sends"),
    "reduce_scatter_tensor_coalesced": _functional("reduce_scatter", "inputs", "sends"),
    "all_to_all_single": _functional("all_to_all", "input", "sends"),
    "broadcast": _functional("broadcast", "input", "sends"),
    "broadcast_": CollectiveSchema("broadcast", ("input",), ("input",), "sends"),
    "isend": CollectiveSchema("send_recv", ("tensor",), (), "sends"),
    "irecv": CollectiveSchema("send_recv", (), None, "receives"),
}
_AUTOGRAD = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
_C10D = {
    "allreduce_": CollectiveSchema("all_reduce", ("tensors",), ("tensors",), "sends"),
    "allreduce_coalesced_": CollectiveSchema("all_reduce", ("tensors",), ("tensors",), "sends"),
    "_allgather_base_": CollectiveSchema(
        "all_gather", ("input_tensor",), ("output_tensor",), "receives"
    ),
    "allgather_": CollectiveSchema(
        "all_gather", ("input_tensors",), ("output_tensors",), "receives"
    ),
    "allgather_coalesced_": CollectiveSchema(
        "all_gather", ("input_list",), ("output_lists",), "receives"
    ),
    "allgather_into_tensor_coalesced_": CollectiveSchema(
        "all_gather", ("inputs",), ("outputs",), "receives"
    ),
    "_reduce_scatter_base_": CollectiveSchema(
        "reduce_scatter", ("input_tensor",), ("output_tensor",), "sends"
    ),
    "reduce_scatter_": CollectiveSchema(
        "reduce_scatter", ("input_tensors",), ("output_tensors",), "sends"
    ),
    "reduce_scatter_tensor_coalesced_": CollectiveSchema(
        "reduce_scatter", ("inputs",), ("outputs",), "sends"
    ),
    "alltoall_base_": CollectiveSchema("all_to_all", ("input",), ("output",), "sends"),
    "alltoall_": CollectiveSchema("all_to_all", ("input_tensors",), ("output_tensors",), "sends"),
    "broadcast_": CollectiveSchema("broadcast", ("tensors",), ("tensors",), "sends"),
    # NB: a reduce to one root is priced as a broadcast run backwards (nccl-tests: bus
    # factor 1 for both; every rank forwards S once along the chain).
    "reduce_": CollectiveSchema("broadcast", ("tensors",), ("tensors",), "sends"),
    "send": CollectiveSchema("send_recv", ("tensors",), (), "sends"),
    "recv_": CollectiveSchema("send_recv", (), ("tensors",), "receives"),
    "recv_any_source_": CollectiveSchema("send_recv", (), ("tensors",), "receives"),
    # NB: NCCL's barrier is an all-reduce of a one-element buffer.
    "barrier": CollectiveSchema("all_reduce", ("tensor",), (), "sends"),
}
COLLECTIVE_SCHEMAS: dict[str, CollectiveSchema] = {
    **{f"_c10d_functional.{name}": schema for name, schema in _FUNCTIONAL.items()},
    **{f"_c10d_functional_autograd.{name}": _FUNCTIONAL[name] for name in _AUTOGRAD},
    **{f"c10d.{name}": schema for name, schema in _C10D.items()},
}
"""Every collective packet with a rule, by ``namespace.op``. ``batch_p2p_ops`` (a list of
sends and receives) is priced on its own below."""

BATCH_P2P = "_c10d_functional.batch_p2p_ops"

if torch.distributed.is_available():
    # defines _c10d_functional._wrap_tensor_autograd (the c10d ops come with torch itself)
    import torch.distributed._functional_collectives  # noqa: F401


def _in_this_torch(*packets: str) -> list[str]:
    """The packets this torch defines (none without torch.distributed)."""
    return [p for p in packets if hasattr(getattr(torch.ops, p.split(".")[0]), p.split(".")[1])]


def _named(op: OpRecord, names: tuple[str, ...]) -> list[TensorMeta]:
    return distinct(op.inputs[i] for name in names for i in refs_of(op.args.get(name)))


def _sides(op: OpRecord) -> tuple[list[TensorMeta], list[TensorMeta], str, int]:
    """(tensors sent, tensors received, kind, S in bytes) of one collective op."""
    if op.packet == BATCH_P2P:
        # One tensor per entry of op_list ("isend" / "irecv"); the link is full duplex, so
        # S is the larger direction.
        sent: list[TensorMeta] = []
        received: list[TensorMeta] = []
        for entry, tensor in zip(op.arg("op_list", []), op.tensors("tensors"), strict=True):
            (sent if entry == "isend" else received).append(tensor)
        message = max(_nbytes(sent), _nbytes(received))
        return distinct(sent), distinct(received), "send_recv", message
    schema = COLLECTIVE_SCHEMAS.get(op.packet)
    if schema is None:
        raise ValueError(f"{op.name} is not a collective torchroof prices")
    sent = _named(op, schema.sends)
    received = distinct(op.outputs) if schema.receives is None else _named(op, schema.receives)
    message = _nbytes(sent if schema.message == "sends" else received)
    if schema.kind == "all_to_all" and _one_peer(op.arg("input_split_sizes")):
        # a permutation (funcol.permute_tensor: context parallel's ring passes dK, dV on):
        # the whole buffer goes to one peer, a send and a receive, not an all-to-all
        return sent, received, "send_recv", message
    return sent, received, schema.kind, message


def _one_peer(splits: object) -> bool:
    """An all-to-all's input split sizes send to exactly one rank."""
    return isinstance(splits, (list, tuple)) and sum(1 for n in splits if n) == 1


def pair_ranks(op: OpRecord, group_ranks: list[int]) -> list[list[int]]:
    """The pairs of ranks a send or receive crosses. A group of one or two ranks, or an op
    that is no permutation, is its recorded group as it stands (a point-to-point op's
    pair). A permutation (an all-to-all whose split sizes send to one peer: context
    parallel's ring passing dK, dV on) is the traced rank with the peer it sends to, and,
    where its output split sizes name one, with the peer it receives from (the ring moves
    in step, so the slower hop sets its pace); a hop to itself is the rank alone (no
    link). The traced rank is rank 0 of its program, the first of each of its groups'
    ranks (torchroof.parallel.program)."""
    sends, receives = op.arg("input_split_sizes"), op.arg("output_split_sizes")
    if len(group_ranks) <= 2 or not _one_peer(sends):
        return [list(group_ranks)]
    own = group_ranks[0]
    hops = [(own, group_ranks[_peer(sends)])]  # (source, target)
    if _one_peer(receives):
        hops.append((group_ranks[_peer(receives)], own))
    return [[source, target] if source != target else [own] for source, target in hops]


def _peer(splits: object) -> int:
    """The index of the one non-zero split size (:func:`_one_peer` holds)."""
    assert isinstance(splits, (list, tuple))
    return next(i for i, n in enumerate(splits) if n)


def _nbytes(tensors: list[TensorMeta]) -> int:
    return sum(t.nbytes for t in distinct(tensors))


def collective_kind(op: OpRecord) -> str:
    """The collective ``op`` runs, as torchroof.timing.network names it (``"all_reduce"``)."""
    return _sides(op)[2]


def message_bytes(op: OpRecord) -> int:
    """nccl-tests' S for ``op``: the all-reduced buffer, the gathered output of an
    all-gather, the full input of a reduce-scatter, a rank's send buffer of an all-to-all,
    the broadcast buffer, the message of a send or receive."""
    return _sides(op)[3]


def group_size(op: OpRecord) -> int:
    """Ranks in the op's process group, as capture recorded it."""
    size = op.arg("group_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"op {op.index} ({op.name}) has no recorded group size (group_size={size!r}); "
            "trace it again with this torchroof, which records each collective's group"
        )
    return size


def wire_bytes(op: OpRecord) -> int:
    """Bytes one rank sends on the wire: S x bus_factor(kind, group size) (nccl-tests bus
    bandwidth definition; ring all-reduce 2(n-1)/n, all-gather and reduce-scatter
    (n-1)/n, torchroof.counters.bus.bus_factor)."""
    _, _, kind, message = _sides(op)
    return round(message * bus_factor(kind, group_size(op)))


def collective_cost(op: OpRecord) -> Cost:
    """W = 0 on the ``network`` unit; Q = the local tensors read (sent) plus those written
    (received), each once: an all-gather reads its shard and writes the gathered buffer,
    an in-place all-reduce reads and writes its buffer."""
    sent, received, _, _ = _sides(op)
    sent_keys = {tensor_key(t) for t in sent}
    reads = tuple((t, t.nbytes if tensor_key(t) in sent_keys else 0) for t in distinct(op.inputs))
    writes = tuple((t, t.nbytes) for t in received)
    read = sum(n for _, n in reads)
    written = sum(n for _, n in writes)
    return Cost(
        0, read, written, "network", compute_dtype([*sent, *received]), reads=reads, writes=writes
    )


register(*_in_this_torch(*COLLECTIVE_SCHEMAS, BATCH_P2P), kind="collective")(collective_cost)


@register(
    *_in_this_torch("_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"),
    kind="view",
)
def collective_sync(op: OpRecord) -> Cost:
    """wait_tensor / _wrap_tensor_autograd: no kernel, no bytes (the collective it waits
    for is priced where it was issued)."""
    return ZERO


# -- FSDP2's own copies around its collectives ------------------------------------------------
# torch.distributed.fsdp registers these as ops of its own (``fsdp::``); FSDP2 runs the first
# two on its collective streams (torchroof.timing.streams). Each moves every byte once.
FSDP_COPIES = ("fsdp.all_gather_copy_in", "fsdp.chunk_cat", "fsdp.split_with_sizes_copy")


def _copy(op: OpRecord, read: list[TensorMeta], written: list[TensorMeta]) -> Cost:
    reads = tuple((t, t.nbytes) for t in distinct(read))
    writes = tuple((t, t.nbytes) for t in distinct(written))
    return Cost(
        0,
        sum(n for _, n in reads),
        sum(n for _, n in writes),
        "vector",
        compute_dtype([*read, *written]),
        reads=reads,
        writes=writes,
    )


def fsdp_copy(op: OpRecord) -> Cost:
    """FSDP2's copies, W = 0, each byte read once and written once:

    - ``all_gather_copy_in(all_gather_inputs, all_gather_output, ...)``: the rank's shards
      are copied into its slice of the all-gather buffer (written: the shards' bytes; the
      rest of the buffer is the collective's to fill);
    - ``chunk_cat(tensors, ..., out=)``: the unsharded gradients are packed into the
      reduce-scatter input ``out``;
    - ``split_with_sizes_copy(all_gather_output, ..., out=[...])``: the gathered buffer is
      copied out into each unsharded parameter.
    """
    if op.packet == "fsdp.all_gather_copy_in":
        shards = _named(op, ("all_gather_inputs",))
        return _copy(op, shards, shards)  # the slice written is as large as the shards
    if op.packet == "fsdp.chunk_cat":
        return _copy(op, _named(op, ("tensors",)), _named(op, ("out",)))
    return _copy(op, _named(op, ("all_gather_output",)), _named(op, ("out",)))


# opaque: FSDP2 launches each as a kernel of its own, on its own stream for the first two
# by name: importing torch.distributed.fsdp to ask whether they exist costs every start-up
# ~0.75 s; a trace only holds them once FSDP2 (which defines them) has run
register(*FSDP_COPIES, kind="opaque")(fsdp_copy)
