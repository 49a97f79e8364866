"""DTensor's choice of sharding on symbolic sizes, written down only where it matters.

For each op on a DTensor, DTensor lists the ways the op may be sharded over the mesh and
drops those that split a dimension into more shards than it is long
(``is_tensor_shardable`` in ``torch/distributed/tensor/_ops/utils.py``); of those left it
takes the one whose inputs cost least to redistribute
(``ShardingPropagator.propagate_op_sharding_non_cached``). On a symbolic size the length
test is a guard: the embedding of a decode at tensor parallel 8 asks whether
``batch >= 8`` to list a split of its token ids that it never takes, and a symbolic trace
at batch 8 would then hold only from 8 up, though a batch of 4 runs the same ops.

:func:`choices_on_open_sizes` asks each op's propagation again under every answer to the
length tests its sizes leave open (no guard written for them): where every answer leads to
the same choice (the output's placements and shard order, and those the inputs are
redistributed to), that choice is the op's at every size, and no decision is written
down; where any answer chooses otherwise, or cannot be propagated, or a propagation asks
more than :data:`MAX_OPEN_TESTS` open tests, the op is propagated as DTensor propagates
it, its guards written down (and any other guard the propagations under other answers
wrote, such as a comparison of their costs: a trace that holds at fewer points, never a
wrong one).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

MAX_OPEN_TESTS = 3  # at most 2**3 propagations of one op
"""The most length tests left open in one op's propagation that are each answered both
ways; past it the op is propagated as DTensor does, its guards written down."""

_Test = tuple[Any, int]  # (a symbolic size's expression, the shards it must hold)


class _Asked:
    """The open length tests of one propagation, with the answer each was given (the
    answer at the symbols' hints, unless ``answers`` says otherwise)."""

    def __init__(self, answers: dict[_Test, bool]) -> None:
        self.answers = answers
        self.asked: dict[_Test, bool] = {}

    def at_least(self, size: Any, shards: int) -> bool:
        """Whether ``size`` is at least ``shards``: a guard-free answer where the symbols'
        ranges decide it, else this propagation's answer to the open test."""
        if not isinstance(size, torch.SymInt):
            return bool(size >= shards)
        if statically_known_true(size >= shards):
            return True
        if statically_known_true(size < shards):
            return False
        test = (size.node.expr, shards)
        hint = size.node.shape_env.optimization_hint(size.node.expr)
        given = self.answers.get(test, bool(hint >= shards))
        self.asked[test] = given
        return given


_ASKED: ContextVar[_Asked | None] = ContextVar("torchroof_shardability", default=None)


@contextlib.contextmanager
def choices_on_open_sizes() -> Iterator[None]:
    """Inside: DTensor's length tests on symbolic sizes are written down as decisions only
    where an op's choice of sharding depends on them (a pass-through for ops on plain
    sizes; with a torch without these private functions, every test is written down as
    before). NB: patches of private torch functions (process-wide), undone on exit."""
    patched = _patches()
    if patched is None:
        yield
        return
    modules, real_test, propagator = patched

    def shardable(shape: Sequence[Any], spec: Any, *args: Any, **kwargs: Any) -> bool:
        asked = _ASKED.get()
        if asked is None or not _symbolic_backed(shape):
            return real_test(shape, spec, *args, **kwargs)
        return _shardable(shape, spec, asked)

    held = vars(propagator).get("propagate_op_sharding_non_cached")  # an outer capture's
    real_propagate = propagator.propagate_op_sharding_non_cached
    saved = [(module, module.is_tensor_shardable) for module in modules]
    for module in modules:
        module.is_tensor_shardable = shardable
    propagator.propagate_op_sharding_non_cached = _propagating(real_propagate)
    try:
        yield
    finally:
        for module, value in saved:
            module.is_tensor_shardable = value
        if held is None:
            del propagator.propagate_op_sharding_non_cached  # the class's method again
        else:
            propagator.propagate_op_sharding_non_cached = held


def _patches() -> tuple[list[Any], Callable[..., bool], Any] | None:
    """The modules of torch that call ``is_tensor_shardable`` by a name of their own
    (those that import it inside a function read it from ``utils``), torch's function, and
    DTensor's sharding propagator; None where this torch has not got them."""
    try:
        import torch.distributed.tensor._ops._matrix_ops as matrix_ops
        import torch.distributed.tensor._ops.utils as utils
        from torch.distributed.tensor import DTensor

        real_test = utils.is_tensor_shardable
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding_non_cached  # noqa: B018 - present in this torch
        _placement_types()
    except (ImportError, AttributeError):
        return None
    modules = [
        m for m in (utils, matrix_ops) if getattr(m, "is_tensor_shardable", None) is real_test
    ]
    return modules, real_test, propagator


def _placement_types() -> tuple[Any, Any, Any]:
    """torch's shard test, strided shard and masked partial placement (private names)."""
    from torch.distributed.tensor.placement_types import (
        _is_shard_like,
        _MaskPartial,
        _StridedShard,
    )

    return _is_shard_like, _StridedShard, _MaskPartial


def _symbolic_backed(shape: Sequence[Any]) -> bool:
    """Whether ``shape`` has a symbolic size, none of them data-dependent."""
    symbolic = [size for size in shape if isinstance(size, torch.SymInt)]
    return bool(symbolic) and not any(free_unbacked_symbols(size.node.expr) for size in symbolic)


def _shardable(shape: Sequence[Any], spec: Any, asked: _Asked) -> bool:
    """``is_tensor_shardable`` of torch (each dimension at least as long as the shards the
    spec splits it into, the split factor of a strided shard included), its tests on
    symbolic sizes answered by ``asked``."""
    is_shard_like, strided_shard, _ = _placement_types()
    shards = [1] * len(shape)
    for index, placement in enumerate(spec.placements):
        if not is_shard_like(placement):
            continue
        dim = placement.dim
        if dim >= len(shape):
            return False
        shards[dim] *= int(spec.mesh.size(index))
        needed = shards[dim]
        if isinstance(placement, strided_shard):
            needed *= int(placement.split_factor)
        if not asked.at_least(shape[dim], needed):
            return False
    return True


def _propagating(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``real`` (an op schema's propagation) asked under every answer to the open length
    tests it meets: its choice where every answer makes the same, else ``real`` as DTensor
    runs it (its guards written down)."""

    def propagate(op_schema: Any) -> Any:
        if _ASKED.get() is not None:  # a propagation inside one (a decomposition's ops)
            return real(op_schema)
        try:
            first, asked = _asking(real, op_schema, {})
        except Exception:  # noqa: BLE001 - DTensor's own propagation says it
            return real(op_schema)
        if not asked:
            return first
        if len(asked) > MAX_OPEN_TESTS:
            return real(op_schema)
        tests = list(asked)
        for answers in itertools.product((True, False), repeat=len(tests)):
            given = dict(zip(tests, answers, strict=True))
            if given == asked:
                continue  # the first propagation's
            try:
                other, more = _asking(real, op_schema, given)
            except Exception:  # noqa: BLE001 - an answer the op cannot take: decided as DTensor does
                return real(op_schema)
            if not more.keys() <= asked.keys() or not same_choice(first, other):
                return real(op_schema)
        return first

    return propagate


def _asking(
    real: Callable[[Any], Any], op_schema: Any, answers: dict[_Test, bool]
) -> tuple[Any, dict[_Test, bool]]:
    """``real(op_schema)`` with the open tests answered by ``answers`` (the hints'
    answers for the others), and every open test it asked with its answer."""
    asked = _Asked(answers)
    token = _ASKED.set(asked)
    try:
        return real(op_schema), asked.asked
    finally:
        _ASKED.reset(token)


def same_choice(first: Any, other: Any) -> bool:
    """Whether two propagations of one op chose alike: the same output placements, the
    same redistribution of the inputs (their placements), the same flags."""
    if first.needs_redistribute != other.needs_redistribute:
        return False
    if first.use_val_from_redistribute_schema != other.use_val_from_redistribute_schema:
        return False
    if not _same(first.output_spec, other.output_spec):
        return False
    a, b = first.redistribute_schema, other.redistribute_schema
    if a is None or b is None:
        return a is b
    return _same(a.args_schema, b.args_schema) and _same(a.kwargs_schema, b.kwargs_schema)


def _same(a: Any, b: Any) -> bool:
    """Specs alike by mesh, placements and shard order, symbolic sizes by their
    expressions, sequences and mappings item by item, anything else only where it is the
    same object or an equal plain value (a symbolic size is never compared as a number,
    which would write a guard)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if isinstance(a, DTensorSpec) or isinstance(b, DTensorSpec):
        order = ("shard_order", "use_strided_shard_as_shard_order")  # where torch has them
        return (
            isinstance(a, DTensorSpec)
            and isinstance(b, DTensorSpec)
            and a.mesh is b.mesh
            and len(a.placements) == len(b.placements)
            and all(map(_same_placement, a.placements, b.placements))
            and all(getattr(a, name, None) == getattr(b, name, None) for name in order)
        )
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)  # alike as expressions: no guard
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if a is b:
        return True
    plain = (int, float, bool, str, type(None), torch.dtype, torch.device)
    return type(a) is type(b) and isinstance(a, plain) and a == b


def _same_placement(a: Any, b: Any) -> bool:
    """Placements alike; a masked partial (a vocabulary-parallel embedding's) by what it
    masks, not by the buffer each propagation makes for its mask."""
    masked = _placement_types()[2]
    if isinstance(a, masked) and isinstance(b, masked):
        fields = ("reduce_op", "offset_shape", "offset_dim")
        return type(a) is type(b) and all(getattr(a, f) == getattr(b, f) for f in fields)
    return bool(a == b)
