"""A step traced with its sizes as symbols: batch, sequence and context are PyTorch symbolic
integers (``torch.SymInt`` over a ``ShapeEnv``, under ``FakeTensorMode``: PyTorch docs,
"Dynamic shapes" and "Fake tensor"), so every tensor the model makes has sizes that follow
them, and what the capture records is a :class:`~torchroof.records.dims.Dim` (the traced
number and the polynomial it follows).

Everything the model and torch decided on a size is a guard of the ``ShapeEnv`` (``s0 > 1``,
``Eq(s1, 4096)``); everything torchroof's own capture decided on a recorded Dim is a
:class:`~torchroof.records.dims.Decision`. A point where they all come out the same is
the same program at other numbers (:mod:`torchroof.records.symbolic_trace`).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchroof.quiet import SYMBOLIC_LOG_LINES, drop_log_lines
from torchroof.records.dims import Dim, follow, value_of
from torchroof.records.expressions import Decision, Decisions, Node, Poly, combined, deciding
from torchroof.records.tensors import clear_layout_caches

_ACTIVE: contextvars.ContextVar[SymbolicSizes | None] = contextvars.ContextVar(
    "torchroof_symbolic_sizes", default=None
)


class NotSymbolic(Exception):
    """The step cannot be traced with these sizes as symbols (said in one line)."""


class SymbolicSizes:
    """The symbols of one capture (``{"batch": 8, "context": 4096}``: each a SymInt whose
    hint is the number given), the fake-tensor mode they live in, and the decisions taken
    on them."""

    def __init__(self, hints: Mapping[str, int]) -> None:
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        self.hints = dict(hints)
        self.env = ShapeEnv(specialize_zero_one=False, duck_shape=False)
        self.sizes: dict[str, Any] = {}  # axis -> its SymInt
        self._axis: dict[Any, str] = {}  # ShapeEnv symbol -> axis name
        for name, hint in self.hints.items():
            symbol = self.env.create_symbol(
                hint, ConstantSource(f"torchroof_{name}"), dynamic_dim=DimDynamic.DYNAMIC
            )
            self.sizes[name] = self.env.create_symintnode(symbol, hint=hint)
            self._axis[symbol] = name
        self.decisions = Decisions()
        self._exprs: dict[Any, Any] = {}
        self._mode: Any = None
        self._real: dict[int, torch.Tensor] = {}  # a fake copy's storage -> the meta tensor
        self._fakes: list[torch.Tensor] = []

    def adopt(self, module: torch.nn.Module) -> None:
        """Make the fake copies of ``module``'s parameters and buffers now (fake tensor
        mode makes them on first use), so that the storage of each is known as its meta
        tensor's: the weights a layer reads stay the weights the capture labelled."""
        assert self._mode is not None, "adopt() inside active()"
        for tensor in [*module.parameters(), *module.buffers()]:
            local = getattr(tensor, "_local_tensor", None)  # a DTensor's shard
            if local is not None:
                tensor = local
            if is_fake(tensor):
                continue
            fake = self._mode.from_tensor(tensor, static_shapes=True)
            self._fakes.append(fake)  # held: the mode's memo of it is weak
            self._real[fake.untyped_storage()._cdata] = tensor

    def real_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The meta tensor whose fake copy's storage ``tensor`` views, if any."""
        try:
            return self._real.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    @contextlib.contextmanager
    def active(self) -> Iterator[SymbolicSizes]:
        """Inside: new tensors are fake with symbolic sizes, :func:`sized` records Dims and
        decisions on them are written down."""
        from torchroof.capture.eager_fake import EagerViewsFakeMode, eager_collective_results
        from torchroof.capture.sharding_choice import choices_on_open_sizes

        token = _ACTIVE.set(self)
        clear_layout_caches()  # each comparison on a size is made, and written down, here
        try:
            fake = EagerViewsFakeMode(shape_env=self.env, allow_non_fake_inputs=True)
            # the fake mode takes eager's paths (views' strides, collectives' results)
            with (
                fake as mode,
                eager_collective_results(),
                choices_on_open_sizes(),
                drop_log_lines(SYMBOLIC_LOG_LINES),
            ):
                # its cache of op outputs costs more than it saves with symbolic sizes
                mode.cache_enabled = False
                self._mode = mode
                with deciding(self.decisions):
                    yield self
        finally:
            self._mode = None
            self._fakes.clear()
            self._real.clear()
            _ACTIVE.reset(token)

    def size(self, name: str, value: int) -> Any:
        """The symbol ``name`` where its hint is ``value``, else ``value`` (a size that is
        not this capture's axis)."""
        found = self.sizes.get(name)
        return found if found is not None and self.hints[name] == value else value

    def dim(self, value: Any) -> int:
        """A SymInt as the Dim it is (a plain int where it is a number); one whose
        expression is not one of the axes' is fixed to its hint (a guard)."""
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = self.env.replace(value.node.expr)
        if expr not in self._exprs:
            self._exprs[expr] = self._expr(expr)
        converted = self._exprs[expr]
        if converted is None:
            return int(value)  # guard_int: the ShapeEnv writes the guard down
        return follow(int(self.env.optimization_hint(expr)), converted)

    def _expr(self, expr: Any) -> Any:
        """A sympy expression of the ShapeEnv as a :mod:`~torchroof.records.dims`
        expression over the axes' names (None where it is not one: another symbol, an
        operation Python's integers do not have)."""
        import sympy

        if isinstance(expr, sympy.Integer):
            return Poly.constant(int(expr))
        if isinstance(expr, sympy.Float):
            return float(expr)
        if isinstance(expr, sympy.Symbol):
            name = self._axis.get(expr)
            return Poly.symbol(name) if name is not None else None
        args = [self._expr(a) for a in expr.args]
        if any(a is None for a in args):
            return None
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            return _folded("add" if isinstance(expr, sympy.Add) else "mul", args)
        if isinstance(expr, sympy.Pow) and isinstance(expr.args[1], sympy.Integer):
            return _folded("pow", args)
        operation = _SYMPY_OPERATIONS.get(type(expr).__name__)
        if operation == "float" and len(args) == 1:
            return Node("float", (args[0],))
        if operation is None or len(args) != 2:
            return None
        return _folded(operation, args)

    def guards(self) -> list[Decision]:
        """What the model and torch decided on the symbols (the ShapeEnv's guards, and the
        ranges it assumed for each symbol) as decisions; :class:`NotSymbolic` when one is
        not a comparison of polynomials in the axes."""
        import sympy

        out: list[Decision] = []
        for guard in self.env.guards:
            out.append(self._decision(guard.expr))
        for symbol, name in self._axis.items():
            bounds = self.env.var_to_range.get(symbol)  # torch's value ranges
            axis = Poly.symbol(name)
            if bounds is None:
                continue
            low, high = bounds.lower, bounds.upper
            if isinstance(low, sympy.Integer):
                out.append(Decision(axis - Poly.constant(int(low)), ">=", 0, True))
            if isinstance(high, sympy.Integer):
                out.append(Decision(Poly.constant(int(high)) - axis, ">=", 0, True))
            replaced = self.env.replacements.get(symbol)
            if replaced is not None:
                value = self._expr(replaced)
                if value is None:
                    raise NotSymbolic(f"{name} was replaced by {replaced}")
                out.append(Decision(axis, "==", value, True))
        if self.env.deferred_runtime_asserts and any(self.env.deferred_runtime_asserts.values()):
            raise NotSymbolic("the step asserted on a data-dependent size")
        return out

    def _decision(self, expr: Any) -> Decision:
        import sympy

        relations = {
            sympy.Eq: ("==", True, False),
            sympy.Ne: ("==", False, False),
            sympy.StrictGreaterThan: (">", True, False),
            sympy.GreaterThan: (">=", True, False),
            sympy.StrictLessThan: (">", True, True),
            sympy.LessThan: (">=", True, True),
        }
        for kind, (relation, holds, flip) in relations.items():
            if isinstance(expr, kind):
                lhs, rhs = (self._expr(a) for a in expr.args)
                if lhs is None or rhs is None:
                    break
                decision = Decisions()
                decision.note(*((rhs, relation, lhs) if flip else (lhs, relation, rhs)), holds)  # type: ignore[arg-type]
                return next(iter(decision))
        if isinstance(expr, sympy.Not):
            inner = self._decision(expr.args[0])
            return Decision(inner.lhs, inner.relation, inner.rhs, not inner.holds)
        raise NotSymbolic(f"a guard on the sizes is not a comparison of polynomials: {expr}")


# torch.utils._sympy.functions' integer operations, by class name, as Python applies them
# to non-negative sizes (the ShapeEnv's guards on them hold for sizes)
_SYMPY_OPERATIONS = {
    "FloorDiv": "floordiv",
    "CleanDiv": "floordiv",
    "Mod": "mod",
    "PythonMod": "mod",
    "Max": "max",
    "Min": "min",
    "FloatTrueDiv": "truediv",
    "IntTrueDiv": "truediv",
    "ToFloat": "float",
}


def _folded(operation: str, args: list[Any]) -> Any:
    """``args`` folded left by ``operation``, as integer polynomials where they stay ones."""
    out = args[0]
    for arg in args[1:]:
        if operation == "pow" and isinstance(out, Poly) and isinstance(arg, Poly):
            power = arg.constant_term
            if arg.is_constant and power >= 0:
                result = Poly.constant(1)
                for _ in range(power):
                    result = result * out
                out = result
                continue
        out = combined(operation, out, arg)
    return out


def is_fake(value: torch.Tensor) -> bool:
    """A fake tensor: every tensor of a capture with symbolic sizes, and of a step whose
    parameters are fake (FSDP2's, :func:`torchroof.parallel.fsdp.fake_parameters`)."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # imported by whoever made one
    return fake is not None and type(value) is fake.FakeTensor


def fake_mode_on() -> bool:
    """Whether a fake tensor mode is on the dispatch mode stack."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is None:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, fake.FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def tensors_made_aside(capture: Any) -> Any:
    """Where a capture makes tensors that are not part of the step (a copied layer's
    outputs): with every mode off (meta tensors), or, under a fake tensor mode (symbolic
    sizes, FSDP2's fake parameters), fake and not recorded."""
    from torch.utils._python_dispatch import _disable_current_modes

    return capture.unrecorded() if fake_mode_on() else _disable_current_modes()


def active_sizes() -> SymbolicSizes | None:
    """The symbolic capture running now, if one is."""
    return _ACTIVE.get()


def sized(value: Any) -> int:
    """A size as the capture records it: the Dim a SymInt is inside a symbolic capture, a
    plain int otherwise."""
    if isinstance(value, torch.SymInt):
        sizes = _ACTIVE.get()
        return sizes.dim(value) if sizes is not None else int(value)
    return int(value)


class ByValue:
    """A size as part of a key that must compare as the int it stands for does: equal to
    another where their values are (a decision written down where their expressions
    differ), hashed by its value. Two layer calls are alike this way exactly when they are
    in a trace at numbers (:mod:`torchroof.capture.layer_calls`)."""

    __slots__ = ("size",)

    def __init__(self, size: Any) -> None:
        self.size = size

    def __hash__(self) -> int:
        return hash(value_of(self.size))

    def __eq__(self, other: object) -> bool:
        theirs = other.size if isinstance(other, ByValue) else other
        return isinstance(theirs, int) and bool(self.size == theirs)

    def __repr__(self) -> str:
        return f"ByValue({self.size!r})"


def keyed(value: Any) -> Any:
    """A size (an int or a SymInt) for a key: the int, or its Dim :class:`ByValue`."""
    size = sized(value)
    return ByValue(size) if isinstance(size, Dim) else size


def step_size(name: str, value: int) -> Any:
    """The step's size ``name`` (``batch``, ``seq``, ``context``): its symbol inside a
    symbolic capture of that axis, else ``value``."""
    sizes = _ACTIVE.get()
    return sizes.size(name, value) if sizes is not None else value
