"""A trace whose ops its cost rules cannot read: found and named, never a traceback.

A saved trace passes :mod:`torchroof.records.trace`' structure and arity checks before it is
built; an op that still breaks its rule (a hand-edited shape a rule indexes, a scalar
argument of the wrong type) makes pricing raise deep inside a counter. The error is then
traced back to the first op whose rule fails, and reported as one line naming it.
"""

from __future__ import annotations

from torchroof.config import Workload
from torchroof.config.errors import OptionError, first_line
from torchroof.counters import cost_of
from torchroof.hardware import ClusterSpec
from torchroof.records.facts import StepFacts
from torchroof.records.trace import Trace
from torchroof.records.trace_file import TraceFileError

# What a cost rule raises when it is handed an op it cannot read.
RULE_ERRORS = (IndexError, KeyError, TypeError, AttributeError, OverflowError, ValueError)


def unpriceable_op(trace: Trace) -> TraceFileError | None:
    """A :class:`TraceFileError` naming the first op of ``trace`` whose cost rule fails
    (its position, name and the rule's complaint), or None when every rule reads its op."""
    for position, op in enumerate(trace.ops):
        try:
            cost_of(op)
        except RULE_ERRORS as error:
            return TraceFileError(
                [f"ops[{position}] ({op.name}): its cost rule cannot read it ({first_line(error)})"]
            )
    return None


def recorded_tokens_problem(facts: StepFacts) -> str | None:
    """The recorded tokens against those the recorded workload's regime processes
    (prefill and train B x seq, x micro-batches; decode B), or None when they agree or
    there is no single-stage workload to check them by (a hand-traced block, a pipeline)."""
    from torchroof.workloads import regime

    recorded = facts.workload
    if recorded is None or not facts.tokens or recorded.pp != 1:
        return None
    sizes = ("regime", "batch", "seq", "context", "microbatches")
    try:  # the sizes alone: the tokens a regime processes depend on nothing else
        workload = Workload(**{k: getattr(recorded, k) for k in sizes})
    except (ValueError, TypeError):
        return None
    wanted = regime(workload.regime).tokens(workload)
    if facts.tokens == wanted:
        return None
    return (
        f'"metadata"."tokens" is {facts.tokens:,}, but a {workload.regime} step of the '
        f"workload recorded processes {wanted:,}"
    )


def check_cluster_fits(workload: Workload, cluster: ClusterSpec) -> None:
    """Refuse a step over more GPUs than the cluster has: one node without a [network],
    ``max_nodes`` nodes when the file states them (the report would otherwise price the
    step "over the N GPUs" of a cluster that has fewer)."""
    world = workload.parallel_plan.world
    per_node = cluster.gpus_per_node
    if cluster.network is None:
        nodes, why = 1, "has no [network]: it is one node"
    elif cluster.max_nodes is not None:
        nodes, why = cluster.max_nodes, f"has at most {cluster.max_nodes:,} nodes"
    else:
        return
    if world > nodes * per_node:
        raise OptionError(
            f"the step spans {world:,} GPUs (tp x dp x fsdp x cp x pp), but "
            f"{cluster.name} {why} of {per_node} GPUs ({nodes * per_node:,} in all)"
        )
