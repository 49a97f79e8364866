"""MoE routing beyond the balanced split: the experts a batch is expected to reach.

Capture answers routing with the balanced split (:mod:`torchroof.capture.routing`): every
expert gets the same share of the routed rows, so R rows reach min(E, R) of E experts and a
grouped GEMM reads that many experts' weights. Real routers pick experts per token. With T
tokens each choosing k *distinct* experts, expert e is in one token's choice with
probability k·p_e (p_e its share of the routed rows: the router's top-k picks e at most
once per token, so the marginal is k times the share), and tokens choose independently, so
by linearity of expectation the expected number of experts reached is

    Σ_e 1 − (1 − k·p_e)^T,

which for uniform shares p_e = 1/E is E·(1 − (1 − k/E)^T). One token reaches exactly k
(the balanced answer too); at T·k ≥ E balanced routing reaches all E while the expected
count stays below (Mixtral, E = 8, k = 2, T = 4: 8·(1 − 0.75^4) = 5.47 experts). This is
the expectation of the occupancy count for draws without replacement within a token
(Johnson & Kotz, *Urn Models and Their Application*, 1977, ch. 3, the classical occupancy
problem), the form MoE serving papers use to size expert loads at small batch.

The choice is a pricing option (:attr:`PricingOptions.routing`): ``balanced`` (the
default), ``expected`` (uniform random routing) or a measured histogram of the experts'
shares (a comma-separated list or a file of numbers, one per expert, normalised here).
FLOPs stay those of the traced rows whatever the routing (a grouped GEMM's FLOPs are exact
for any split); what changes is the expert weights each grouped GEMM reads and, under
expert parallel with a histogram, the routed rows the busiest rank receives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchroof.config.errors import OptionError
from torchroof.config.routing import BALANCED, HISTOGRAM, Routing
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace

_GROUPED = ("aten._grouped_mm", "torchroof.packed_grouped_mm")


def expected_experts(tokens: float, top_k: int, shares: Sequence[float]) -> float:
    """Σ_e 1 − (1 − k·p_e)^T: the experts ``tokens`` tokens are expected to reach when each
    picks ``top_k`` distinct experts and expert e is picked with share p_e of the rows (see
    the module docstring). A share above 1/k is impossible for distinct picks."""
    for share in shares:
        if top_k * share > 1 + 1e-9:
            raise OptionError(
                f"an expert's share {share:.4g} of the routed rows exceeds 1/top_k = "
                f"{1 / top_k:.4g}: a token picks each expert at most once"
            )
    return sum(1.0 - max(0.0, 1.0 - top_k * p) ** tokens for p in shares)


def top_k_by_experts(trace: Trace) -> dict[int, int]:
    """The router's k for each width it picks from: every ``topk`` of the trace, keyed by
    the size of the dimension it picks along (DeepSeek's group-limited router also picks
    groups; they are keyed by the group count, not the expert count)."""
    found: dict[int, int] = {}
    for op in trace.ops:
        if op.packet != "aten.topk" or not op.inputs:
            continue
        shape = op.inputs[0].shape
        if not shape:
            continue
        dim = int(op.arg("dim", -1))
        found.setdefault(int(shape[dim]), int(op.arg("k")))
    return found


def grouped_gemm(ops: Sequence[OpRecord]) -> tuple[int, int] | None:
    """(routed rows, expert slices) of the grouped GEMM among ``ops`` that reads its
    experts' weights by routed row (x [R, K] against [G, ...] with offsets, or packed
    experts); None when there is none (a weight gradient, a dense GEMM)."""
    for op in ops:
        if op.packet not in _GROUPED:
            continue
        if op.packet == "torchroof.packed_grouped_mm":
            x, codes = op.tensor("x"), op.tensor("codes")
            if x is not None and codes is not None:
                return math.prod(x.shape[:-1]), int(codes.shape[0])
            continue
        a, b = op.tensor("self"), op.tensor("mat2")
        if a is not None and b is not None and len(a.shape) == 2 and len(b.shape) == 3:
            if op.tensor("offs") is not None:
                return int(a.shape[0]), int(b.shape[0])
    return None


@dataclass(frozen=True)
class RoutedRank:
    """What a routing makes of the rank priced: the routed rows its experts receive over
    the balanced share (``imbalance``), and ``reach(rows, slices)``, the expert weights a
    grouped GEMM of ``rows`` rows over ``slices`` local experts reads, over the balanced
    min(slices, rows)."""

    routing: Routing
    top_k: dict[int, int]
    ep: int
    imbalance: float = 1.0
    group: int = 0  # the expert-parallel group priced (the busiest under a histogram)

    def reach(self, rows: int, slices: int) -> float:
        """Expected experts reached over the balanced count (1 under balanced routing)."""
        if self.routing.kind == BALANCED or rows <= 0:
            return 1.0
        experts = slices * self.ep
        k = self.top_k.get(experts, 1)  # no top-k in the trace: each row picks one expert
        shares = self.routing.shares_of(experts)
        local = shares[self.group * slices : (self.group + 1) * slices]
        # the traced rows are the balanced share: rows = T·k / ep over the ep ranks' T tokens
        tokens = rows * self.ep / k
        return expected_experts(tokens, k, local) / min(slices, rows)


def routed_rank(routing: Routing, trace: Trace, ep: int, imbalance: float) -> RoutedRank:
    """The rank to price under ``routing``: with a histogram and expert parallel, the group
    of experts with the largest share (its imbalance is that share times ep, unless
    ``imbalance`` was given: both is an error); otherwise ``imbalance`` as given."""
    top_k = top_k_by_experts(trace) if routing.kind != BALANCED else {}
    if routing.kind != HISTOGRAM or ep <= 1:
        return RoutedRank(routing, top_k, ep, imbalance)
    if imbalance != 1.0:
        raise OptionError(
            "routing_imbalance and a routing histogram both say how the busiest rank is "
            "loaded: give one (the histogram's busiest expert group sets the imbalance)"
        )
    experts = len(routing.shares)
    if experts % ep:
        raise OptionError(
            f"the routing histogram has {experts} shares, not a multiple of ep={ep}: give "
            "one share per routed expert"
        )
    per_rank = experts // ep
    loads = [sum(routing.shares[g * per_rank : (g + 1) * per_rank]) for g in range(ep)]
    busiest = max(range(ep), key=loads.__getitem__)
    return RoutedRank(routing, top_k, ep, loads[busiest] * ep, busiest)
