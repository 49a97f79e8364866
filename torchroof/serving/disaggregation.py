"""Disaggregated prefill and decode: the layout of prefill and decode instances, each
side's knobs, where each instance's GPUs sit on the cluster, and what sending one
request's KV cache from a prefill instance to a decode instance costs.

DistServe (Zhong et al. 2024) and vLLM's disaggregated prefilling (docs.vllm.ai,
"Disaggregated Prefilling") run a request's prompt on a prefill instance and its decode on
another instance, each with its own parallel plan, and send the prompt's KV cache between
them. Here:

- ``xPyD`` (``1P2D``) is x prefill instances and y decode instances. Instances take the
  cluster's GPUs in order, prefill first, each its w GPUs (its tensor-parallel ranks) in a
  row; one that fits in a node but would span two starts at the next node instead, so an
  instance sits within a node when it fits one.
- A request of n prompt tokens sends n x the K and V bytes one token adds over every layer
  and every head: each of the decode instance's tp_d ranks receives its own heads' share
  (n x the bytes per token one decode GPU caches), which the prefill instance's tp_p ranks
  hold between them (vLLM's NixlConnector reads a heterogeneous TP layout so, docs.vllm.ai
  "NixlConnector Usage Guide").
- Rank r of the max(tp_p, tp_d) pairs sends from prefill rank r mod tp_p to decode rank
  r mod tp_d, all pairs at once; the busiest end of a pair moves the whole cache over
  min(tp_p, tp_d) ranks. Each pair is a point-to-point send priced on the link it spans
  (:func:`torchroof.timing.network.collective_time`, ``send_recv``: alpha + bytes / beta,
  NVLink within a node, the network between nodes); the transfer takes the slowest pair.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from torchroof.config import WORKLOAD_KNOBS
from torchroof.config.errors import OptionError
from torchroof.hardware import ClusterSpec
from torchroof.serving.scheduler import EngineConfig
from torchroof.timing.network import collective_time

SIDES = ("prefill", "decode")
ENGINE_KNOBS = tuple(f.name for f in fields(EngineConfig))


@dataclass(frozen=True)
class Layout:
    """How many prefill and decode instances, written ``xPyD``."""

    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: object) -> Layout:
        """``1P2D`` (either case): one prefill instance, two decode instances."""
        found = (
            re.fullmatch(r"\s*(\d+)\s*P\s*(\d+)\s*D\s*", text, re.I)
            if isinstance(text, str)
            else None
        )
        if found is None:
            raise OptionError(
                f"disaggregate takes xPyD (1P2D: one prefill instance, two decode "
                f"instances), got {text!r}"
            )
        layout = cls(int(found.group(1)), int(found.group(2)))
        if layout.prefill < 1 or layout.decode < 1:
            raise OptionError(
                f"disaggregate needs at least one prefill and one decode instance, got {text!r}"
            )
        return layout

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Side:
    """One side's knobs: the workload keywords its model is prepared with (the shared
    ones, then its own) and its engine's."""

    name: str
    knobs: dict[str, Any]
    engine: EngineConfig


def sides(
    shared: Mapping[str, Any],
    engine: EngineConfig,
    prefill: Mapping[str, Any] | None,
    decode: Mapping[str, Any] | None,
) -> tuple[Side, Side]:
    """The prefill and decode sides: each takes ``shared`` (workload and pricing knobs)
    and ``engine``, and its own workload knobs (``tp``, ``ep``, ``dtype``, ...) and engine
    knobs (``max_num_seqs``, ``num_gpu_blocks_override``, ...) over them."""
    out = []
    for name, given in (("prefill", prefill), ("decode", decode)):
        given = {} if given is None else given
        if not isinstance(given, Mapping):
            raise OptionError(f"{name} takes a dict of knobs ({name}={{'tp': 2}}), got {given!r}")
        bad = sorted(k for k in given if k not in WORKLOAD_KNOBS and k not in ENGINE_KNOBS)
        if bad:
            raise OptionError(
                f"{name} takes workload knobs (tp, ep, dtype, kv_dtype, quant, ...) and engine "
                f"knobs ({', '.join(ENGINE_KNOBS)}), not {', '.join(bad)} (pricing is alike "
                "on both sides: give it to serve itself)"
            )
        workload = {k: v for k, v in given.items() if k in WORKLOAD_KNOBS}
        tuned = {k: v for k, v in given.items() if k in ENGINE_KNOBS}
        out.append(Side(name, {**shared, **workload}, replace(engine, **tuned)))
    return out[0], out[1]


@dataclass(frozen=True)
class Placement:
    """The GPUs (cluster ranks) of each prefill and each decode instance."""

    prefill: tuple[tuple[int, ...], ...]
    decode: tuple[tuple[int, ...], ...]


def cluster_gpus(cluster: ClusterSpec) -> int | None:
    """The GPUs a cluster has: one node's without a network, its nodes' where it states
    a limit, else no limit (None)."""
    if cluster.network is None:
        return cluster.gpus_per_node
    if cluster.max_nodes is not None:
        return cluster.max_nodes * cluster.gpus_per_node
    return None


def place(layout: Layout, prefill_gpus: int, decode_gpus: int, cluster: ClusterSpec) -> Placement:
    """Each instance's GPUs in order, prefill instances first, an instance that fits in a
    node moved to the next node's first GPU rather than span two (its steps are priced on
    one node's links); refused where the cluster has fewer GPUs than the instances take."""
    node = cluster.gpus_per_node
    sizes = [prefill_gpus] * layout.prefill + [decode_gpus] * layout.decode
    instances, at = [], 0
    for size in sizes:
        if size <= node and at % node + size > node:
            at += node - at % node
        instances.append(tuple(range(at, at + size)))
        at += size
    have = cluster_gpus(cluster)
    if have is not None and at > have:
        raise OptionError(
            f"{layout} takes {at} GPUs ({layout.prefill} x {prefill_gpus} for prefill, "
            f"{layout.decode} x {decode_gpus} for decode, each within a node of {node}), "
            f"more than {cluster.name}'s {have}"
        )
    return Placement(tuple(instances[: layout.prefill]), tuple(instances[layout.prefill :]))


@dataclass(frozen=True)
class KvSend:
    """One request's KV cache sent from a prefill instance to a decode instance."""

    bytes: int  # the whole cache, every rank's share
    time_s: float
    link: str  # the link of the slowest pair: the intra-node kind or "network"


class KvTransfers:
    """Prices sending a request's KV cache between any prefill and decode instance of
    ``placement`` on ``cluster`` (the module's rules)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        placement: Placement,
        prefill_tp: int,
        decode_tp: int,
        decode_bytes_per_token: int,
    ) -> None:
        self.cluster = cluster
        self.placement = placement
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        self.bytes_per_token = decode_bytes_per_token * decode_tp  # every layer and head

    def send(self, tokens: int, prefill: int, decode: int) -> KvSend:
        """``tokens`` tokens' cache from prefill instance ``prefill`` to decode instance
        ``decode`` (each counted from 0 on its side)."""
        total = tokens * self.bytes_per_token
        busiest = total / min(self.prefill_tp, self.decode_tp)
        senders, receivers = self.placement.prefill[prefill], self.placement.decode[decode]
        pairs = [
            [senders[r % self.prefill_tp], receivers[r % self.decode_tp]]
            for r in range(max(self.prefill_tp, self.decode_tp))
        ]
        slowest = max(
            (collective_time("send_recv", busiest, pair, self.cluster) for pair in pairs),
            key=lambda timed: timed.time_s,
        )
        return KvSend(total, slowest.time_s, slowest.link)
