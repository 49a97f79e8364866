"""Sizes as symbols: a traced size that remembers how it follows the step's batch, sequence
and context, and the decisions taken on it.

A step traced once with its sizes as symbols (:mod:`torchroof.capture.symbolic`) records
every size as a :class:`Dim`: an ``int`` whose value is the size at the point the step was
traced, carrying the expression that gives it at any other point: a :class:`Poly` (an
integer polynomial in the symbols ``batch``, ``seq``, ``context``: ``numel`` of a
``[batch, 8192]`` tensor is ``8192·batch``), or a :class:`Node` over such polynomials where
the arithmetic leaves them (a floor division with a remainder, a float ratio, a rounding).
A float computed from sizes is a :class:`DimFloat` the same way. Every operation is kept
as Python performed it, so evaluating the expression at other numbers repeats the same
integer and float operations in the same order: the result is what running the same code
at those numbers gives, to the last bit.

Every comparison answers as the traced point's numbers do and, inside :func:`deciding`, is
written down as a :class:`Decision` (``8192·batch > 8192`` was true). A point where every
decision comes out the same takes every branch the traced point took, so whatever was
computed from Dims there (a trace, kernels, their W and Q) is that point's by evaluating
its expressions. Where a size leaves for good (text, an index, an exact ``int``), it is
fixed to its traced value, and that is a decision too (``batch == 8``): nothing silently
keeps the traced point's number. This is the guard-and-hint discipline of PyTorch's
symbolic shapes (``torch.SymInt`` and its ``ShapeEnv``, docs: "Dynamic shapes"), kept to
small interned expressions so that a point is checked and evaluated in microseconds
(:func:`compile_values`, :func:`compile_check`).
"""

from __future__ import annotations

from typing import Any

from torchroof.records.expressions import (
    OPERATIONS,
    Node,
    Poly,
    Relation,
    combined,
    compare,
    note,
)


def _operand(value: Any) -> tuple[Any, Any] | None:
    """(expression or number, plain value) of an operand; None for anything else."""
    if isinstance(value, Dim):
        return value.expr, int.__int__(value)
    if isinstance(value, DimFloat):
        return value.expr, float.__float__(value)
    if isinstance(value, int):  # bool included: True + 1 is 2
        plain = int(value)
        return Poly.constant(plain), plain
    if isinstance(value, float):
        return value, value
    return None


def follow(value: Any, expr: Any) -> Any:
    """``value`` (an int or a float) as a Dim or DimFloat following ``expr``; a plain number
    when ``expr`` holds no symbol."""
    if isinstance(expr, Poly) and expr.is_constant:
        return value
    if not isinstance(expr, (Poly, Node)) or not expr.symbols:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    out = int.__new__(Dim, value) if isinstance(value, int) else float.__new__(DimFloat, value)
    out.expr = expr
    return out


def dim(value: int, poly: Poly) -> int:
    """``value`` as a Dim following ``poly`` (a plain int when ``poly`` is a number)."""
    return follow(value, poly)


def _apply(op: str, a: tuple[Any, Any], b: tuple[Any, Any] | None = None) -> Any:
    """``op`` on the operands' values, and the expression that repeats it."""
    if b is None:
        value = OPERATIONS[op](a[1])
        if op == "neg" and isinstance(a[0], Poly):
            return follow(value, -a[0])
        return follow(value, Node(op, (a[0],)))
    return follow(OPERATIONS[op](a[1], b[1]), combined(op, a[0], b[0]))


class _Sized:
    """Arithmetic and comparisons for :class:`Dim` and :class:`DimFloat`: each operation is
    applied to the plain values and kept as an expression; each comparison is decided on
    the values and written down."""

    expr: Any

    def _plain(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def _binary(self, other: Any, op: str, reflected: bool = False) -> Any:
        theirs = _operand(other)
        if theirs is None:
            return NotImplemented
        mine = self._plain()
        return _apply(op, theirs, mine) if reflected else _apply(op, mine, theirs)

    def __add__(self, other: Any) -> Any:
        return self._binary(other, "add")

    def __radd__(self, other: Any) -> Any:
        return self._binary(other, "add", True)

    def __sub__(self, other: Any) -> Any:
        return self._binary(other, "sub")

    def __rsub__(self, other: Any) -> Any:
        return self._binary(other, "sub", True)

    def __mul__(self, other: Any) -> Any:
        return self._binary(other, "mul")

    def __rmul__(self, other: Any) -> Any:
        return self._binary(other, "mul", True)

    def __floordiv__(self, other: Any) -> Any:
        return self._binary(other, "floordiv")

    def __rfloordiv__(self, other: Any) -> Any:
        return self._binary(other, "floordiv", True)

    def __mod__(self, other: Any) -> Any:
        return self._binary(other, "mod")

    def __rmod__(self, other: Any) -> Any:
        return self._binary(other, "mod", True)

    def __truediv__(self, other: Any) -> Any:
        return self._binary(other, "truediv")

    def __rtruediv__(self, other: Any) -> Any:
        return self._binary(other, "truediv", True)

    def __pow__(self, other: Any, modulo: Any = None) -> Any:
        if modulo is not None:
            return pow(self.fixed(), other, modulo)
        return self._binary(other, "pow")

    def __rpow__(self, other: Any) -> Any:
        return self._binary(other, "pow", True)

    def __neg__(self) -> Any:
        return _apply("neg", self._plain())

    def __pos__(self) -> Any:
        return self

    def __abs__(self) -> Any:
        return _apply("abs", self._plain())

    def __round__(self, ndigits: Any = None) -> Any:
        if ndigits is None:
            return _apply("round", self._plain())
        return round(self.fixed(), ndigits)

    def __trunc__(self) -> Any:
        return _apply("trunc", self._plain())

    def __floor__(self) -> Any:
        return _apply("floor", self._plain())

    def __ceil__(self) -> Any:
        return _apply("ceil", self._plain())

    def __divmod__(self, other: Any) -> Any:
        return (self // other, self % other)

    def __rdivmod__(self, other: Any) -> Any:
        return (other // self, other % self)

    # -- comparisons: answered at the traced point, written down --------------------------
    def _decide(self, other: Any, relation: Relation, flip: bool = False) -> Any:
        theirs = _operand(other)
        if theirs is None:
            return NotImplemented
        mine = self._plain()
        lhs, rhs = (theirs, mine) if flip else (mine, theirs)
        holds = compare(lhs[1], relation, rhs[1])
        note(lhs[0], relation, rhs[0], holds)
        return holds

    def __eq__(self, other: object) -> Any:
        if isinstance(other, (Dim, DimFloat)) and other.expr is self.expr:
            if other._plain()[1] == self._plain()[1]:
                return True  # equal at every point: nothing decided
        return self._decide(other, "==")

    def __ne__(self, other: object) -> Any:
        same = self.__eq__(other)
        return same if same is NotImplemented else not same

    def __gt__(self, other: Any) -> Any:
        return self._decide(other, ">")

    def __ge__(self, other: Any) -> Any:
        return self._decide(other, ">=")

    def __lt__(self, other: Any) -> Any:
        return self._decide(other, ">", flip=True)

    def __le__(self, other: Any) -> Any:
        return self._decide(other, ">=", flip=True)

    def __bool__(self) -> bool:
        mine = self._plain()
        note(mine[0], "==", 0, mine[1] == 0)
        return bool(mine[1])

    def __hash__(self) -> int:
        # by the expression: two sizes are one dict key only when they are equal at every
        # point (keys that differ stay apart; records.symbolic_trace checks that a priced
        # point keeps each storage's views apart too); and by the value, so that a cache
        # keyed on sizes (records.tensors' layouts) never answers a size traced at one
        # point (a plan anchored elsewhere) with what it worked out at another
        return hash((self.expr, self._plain()[1]))

    def fixed(self) -> Any:
        """The traced value, decided to stay (``expr == value`` is written down): where the
        size leaves what an expression can follow (text, an index, an exact number)."""
        expr, value = self._plain()
        note(expr, "==", value, True)
        return value

    def __format__(self, spec: str) -> str:
        return format(self.fixed(), spec)

    def __str__(self) -> str:
        return str(self.fixed())


class Dim(_Sized, int):  # type: ignore[misc]  # int's __rpow__ would drop the expression
    """A size: the int it is at the traced point, and the expression it follows."""

    expr: Any

    def _plain(self) -> tuple[Any, Any]:
        return self.expr, int.__int__(self)

    def __int__(self) -> int:
        return self.fixed()

    def __float__(self) -> float:
        return float(self.fixed())

    def __invert__(self) -> Any:
        return ~self.fixed()

    def __lshift__(self, other: Any) -> Any:
        return self.fixed() << other

    def __rshift__(self, other: Any) -> Any:
        return self.fixed() >> other

    def __rlshift__(self, other: Any) -> Any:
        return other << self.fixed()

    def __rrshift__(self, other: Any) -> Any:
        return other >> self.fixed()

    def __and__(self, other: Any) -> Any:
        return self.fixed() & other

    __rand__ = __and__

    def __or__(self, other: Any) -> Any:
        return self.fixed() | other

    __ror__ = __or__

    def __xor__(self, other: Any) -> Any:
        return self.fixed() ^ other

    __rxor__ = __xor__

    __hash__ = _Sized.__hash__
    __eq__ = _Sized.__eq__
    __ne__ = _Sized.__ne__
    __lt__ = _Sized.__lt__
    __le__ = _Sized.__le__
    __gt__ = _Sized.__gt__
    __ge__ = _Sized.__ge__

    def __repr__(self) -> str:
        return f"Dim({int.__int__(self)}, {self.expr!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (follow, (int.__int__(self), self.expr))


class DimFloat(_Sized, float):  # type: ignore[misc]  # as Dim
    """A float worked out from sizes: its value at the traced point, and the expression."""

    expr: Any

    def _plain(self) -> tuple[Any, Any]:
        return self.expr, float.__float__(self)

    def __int__(self) -> int:
        return int(self.fixed())

    def __float__(self) -> float:
        return float(self.fixed())

    __hash__ = _Sized.__hash__
    __eq__ = _Sized.__eq__
    __ne__ = _Sized.__ne__
    __lt__ = _Sized.__lt__
    __le__ = _Sized.__le__
    __gt__ = _Sized.__gt__
    __ge__ = _Sized.__ge__

    def __repr__(self) -> str:
        return f"DimFloat({float.__float__(self)!r}, {self.expr!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (follow, (float.__float__(self), self.expr))


def log2(size: Any) -> Any:
    """``math.log2(size)``, following a size's expression (``math.log2`` itself reads an
    int's value past any method a Dim could answer)."""
    return _call("log2", size)


def isqrt(size: Any) -> Any:
    """``math.isqrt(size)``, following a size's expression (as :func:`log2`)."""
    return _call("isqrt", size)


def _call(op: str, size: Any) -> Any:
    if isinstance(size, (Dim, DimFloat)):
        return _apply(op, size._plain())
    return OPERATIONS[op](size)


def value_of(size: Any) -> Any:
    """The traced value of a size, decided on nothing (for labels and errors)."""
    if isinstance(size, Dim):
        return int.__int__(size)
    if isinstance(size, DimFloat):
        return float.__float__(size)
    return size


def has_dims(value: Any) -> bool:
    """Does ``value`` hold a Dim (nested in tuples, lists and dicts)?"""
    if isinstance(value, (Dim, DimFloat)):
        return True
    if isinstance(value, (tuple, list)):
        return any(has_dims(v) for v in value)
    if isinstance(value, dict):
        return any(has_dims(v) for v in value.values())
    return False


__all__ = ["Dim", "DimFloat", "dim", "follow", "has_dims", "isqrt", "log2", "value_of"]
