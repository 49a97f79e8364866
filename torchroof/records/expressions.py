"""Expressions over a step's size symbols, and the decisions taken on them.

A :class:`Poly` is an integer polynomial in the symbols (``batch``, ``seq``, ``context``),
interned so that equal polynomials are one object; a :class:`Node` is an operation Python
applies where the arithmetic leaves the polynomials (a floor division with a remainder, a
float ratio, a rounding), over polynomials, nodes and numbers. :func:`evaluate` repeats the
operations at any numbers, as Python performed them (integer or float, in the same order),
so the result is what running the same code at those numbers gives, to the last bit.
A :class:`Decision` is one comparison taken on them and how it came out;
:func:`compile_values` and :func:`compile_check` turn many expressions and decisions into
one Python function of the symbols, checked and evaluated in microseconds. The sizes that
carry them are :mod:`torchroof.records.dims`.
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

Monomial = tuple[tuple[str, int], ...]  # (symbol, exponent) pairs, sorted by symbol
Relation = Literal["==", ">", ">="]


class Poly:
    """A polynomial with integer coefficients in named symbols, immutable and interned (two
    equal polynomials are one object, so equality and hashing are by identity)."""

    __slots__ = ("terms", "symbols", "__weakref__")
    terms: tuple[tuple[Monomial, int], ...]  # sorted, no zero coefficient
    symbols: frozenset[str]

    # held weakly: a polynomial no size follows any more is let go
    _interned: weakref.WeakValueDictionary[tuple[tuple[Monomial, int], ...], Poly] = (
        weakref.WeakValueDictionary()
    )

    def __new__(cls, terms: Mapping[Monomial, int]) -> Poly:
        key = tuple(sorted((m, c) for m, c in terms.items() if c))
        found = cls._interned.get(key)
        if found is None:
            found = object.__new__(cls)
            found.terms = key
            found.symbols = frozenset(name for mono, _ in key for name, _ in mono)
            cls._interned[key] = found
        return found

    @classmethod
    def symbol(cls, name: str) -> Poly:
        return cls({((name, 1),): 1})

    @classmethod
    def constant(cls, value: int) -> Poly:
        return cls({(): value})

    @property
    def is_constant(self) -> bool:
        return not self.symbols

    @property
    def constant_term(self) -> int:
        return next((c for m, c in self.terms if not m), 0)

    def __add__(self, other: Poly) -> Poly:
        out = dict(self.terms)
        for mono, coeff in other.terms:
            out[mono] = out.get(mono, 0) + coeff
        return Poly(out)

    def __neg__(self) -> Poly:
        return Poly({m: -c for m, c in self.terms})

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, other: Poly) -> Poly:
        out: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                mono = _times(m1, m2)
                out[mono] = out.get(mono, 0) + c1 * c2
        return Poly(out)

    def divided(self, other: Poly) -> Poly | None:
        """``self / other`` when it is a polynomial with integer coefficients (exact for
        every value of the symbols), else None. Only a single-term divisor is tried (a
        constant or a monomial: ``8192·b·c / c``), which covers how tensor sizes divide."""
        if len(other.terms) != 1:
            return None
        ((dmono, dcoeff),) = other.terms
        out: dict[Monomial, int] = {}
        for mono, coeff in self.terms:
            if coeff % dcoeff:
                return None
            quotient = _over(mono, dmono)
            if quotient is None:
                return None
            out[quotient] = coeff // dcoeff
        return Poly(out)

    def at(self, values: Mapping[str, int]) -> int:
        """The polynomial's value with each symbol given its number."""
        total = 0
        for mono, coeff in self.terms:
            term = coeff
            for name, power in mono:
                term *= values[name] ** power
            total += term
        return total

    def source(self) -> str:
        """The polynomial as a Python expression over its symbols' names."""
        if not self.terms:
            return "0"
        parts = []
        for mono, coeff in self.terms:
            factors = [str(coeff)] + [name if p == 1 else f"{name}**{p}" for name, p in mono]
            parts.append("*".join(factors))
        return "(" + " + ".join(parts) + ")"

    def __repr__(self) -> str:
        return self.source()[1:-1] if self.terms else "0"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Poly, (dict(self.terms),))


def _times(a: Monomial, b: Monomial) -> Monomial:
    powers = dict(a)
    for name, p in b:
        powers[name] = powers.get(name, 0) + p
    return tuple(sorted(powers.items()))


def _over(a: Monomial, b: Monomial) -> Monomial | None:
    powers = dict(a)
    for name, p in b:
        left = powers.get(name, 0) - p
        if left < 0:
            return None
        if left:
            powers[name] = left
        else:
            powers.pop(name, None)
    return tuple(sorted(powers.items()))


# What a Node applies, as Python applies it to the numbers (the same operation in the same
# order as the traced run: integer or float, by the operands' own types at the point).
OPERATIONS: dict[str, Callable[..., Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "truediv": operator.truediv,
    "pow": operator.pow,
    "neg": operator.neg,
    "abs": abs,
    "round": round,
    "ceil": math.ceil,
    "floor": math.floor,
    "trunc": math.trunc,
    "max": max,
    "min": min,
    "log2": math.log2,
    "float": float,
    "isqrt": math.isqrt,
}


class Node:
    """An operation on expressions and numbers (``truediv(kept, 4096·batch)``), interned."""

    __slots__ = ("op", "args", "symbols", "__weakref__")
    op: str
    args: tuple[Any, ...]
    symbols: frozenset[str]

    _interned: weakref.WeakValueDictionary[tuple[Any, ...], Node] = weakref.WeakValueDictionary()

    def __new__(cls, op: str, args: tuple[Any, ...]) -> Node:
        key = (op, *(_key(a) for a in args))
        found = cls._interned.get(key)
        if found is None:
            found = object.__new__(cls)
            found.op, found.args = op, args
            found.symbols = frozenset().union(
                *(a.symbols for a in args if isinstance(a, (Poly, Node)))
            )
            cls._interned[key] = found
        return found

    def __repr__(self) -> str:
        return f"{self.op}({', '.join(map(repr, self.args))})"


Expr = Poly | Node


def _key(value: Any) -> Any:
    """An argument as an interning key: expressions by identity, a float by its bits (so
    ``0.0`` and ``-0.0`` stay apart), an int by value."""
    if isinstance(value, float):
        return ("f", value.hex())
    return value


def evaluate(expr: Any, numbers: Mapping[str, int], known: dict[Any, Any] | None = None) -> Any:
    """The value of an expression (or a plain number) at ``numbers``, each sub-expression
    worked out once (``known``)."""
    if not isinstance(expr, (Poly, Node)):
        return expr
    memo = {} if known is None else known
    found = memo.get(expr)
    if found is None and expr not in memo:
        if isinstance(expr, Poly):
            found = expr.at(numbers)
        else:
            found = OPERATIONS[expr.op](*(evaluate(a, numbers, memo) for a in expr.args))
        memo[expr] = found
    return found


@dataclass(frozen=True)
class Decision:
    """One comparison taken on symbolic sizes: ``lhs relation rhs`` came out ``holds``."""

    lhs: Any  # an expression or a number
    relation: Relation
    rhs: Any
    holds: bool

    def at(self, numbers: Mapping[str, int], known: dict[Any, Any] | None = None) -> bool:
        """Does the comparison come out the same at these numbers?"""
        a, b = evaluate(self.lhs, numbers, known), evaluate(self.rhs, numbers, known)
        return compare(a, self.relation, b) == self.holds

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset().union(
            *(x.symbols for x in (self.lhs, self.rhs) if isinstance(x, (Poly, Node)))
        )

    def __str__(self) -> str:
        text = f"{self.lhs!r} {self.relation} {self.rhs!r}"
        return text if self.holds else f"not ({text})"


def compare(a: Any, relation: Relation, b: Any) -> bool:
    """``a relation b`` as Python answers it."""
    if relation == "==":
        return bool(a == b)
    if relation == ">":
        return bool(a > b)
    return bool(a >= b)


class Decisions:
    """The decisions taken on symbolic sizes while some work ran (:func:`deciding`), each
    once, in the order first taken."""

    def __init__(self) -> None:
        self._found: dict[tuple[Any, ...], Decision] = {}

    def note(self, lhs: Any, relation: Relation, rhs: Any, holds: bool) -> None:
        if isinstance(lhs, Poly) and isinstance(rhs, (Poly, int)) and not isinstance(rhs, bool):
            lhs, rhs = lhs - (rhs if isinstance(rhs, Poly) else Poly.constant(rhs)), 0
            if lhs.is_constant:
                return  # two numbers: the same at every point
        key = (_key(lhs), relation, _key(rhs))
        if key not in self._found:
            self._found[key] = Decision(lhs, relation, rhs, holds)

    def extend(self, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            self.note(d.lhs, d.relation, d.rhs, d.holds)

    def __iter__(self) -> Iterator[Decision]:
        return iter(self._found.values())

    def __len__(self) -> int:
        return len(self._found)


_ACTIVE: list[Decisions] = []


@contextlib.contextmanager
def deciding(decisions: Decisions | None = None) -> Iterator[Decisions]:
    """Write down every decision taken on a :class:`Dim` inside the block (into
    ``decisions``, or a new log); the log is what a point must reproduce to share the
    block's results."""
    log = decisions if decisions is not None else Decisions()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.pop()


def note(lhs: Any, relation: Relation, rhs: Any, holds: bool) -> None:
    """Write a decision down in the log of the innermost :func:`deciding` (none: nothing)."""
    if _ACTIVE:
        _ACTIVE[-1].note(lhs, relation, rhs, holds)


def combined(op: str, x: Any, y: Any) -> Any:
    """The expression of ``op`` on expressions (or numbers) ``x`` and ``y``: an integer
    polynomial where it stays one (a sum, a product, an exact division, a remainder that
    is always zero), else a :class:`Node`."""
    if isinstance(x, Poly) and isinstance(y, Poly):  # both integer polynomials
        if op == "add":
            return x + y
        if op == "sub":
            return x - y
        if op == "mul":
            return x * y
        if op == "floordiv" and not (y.is_constant and y.constant_term == 0):
            quotient = x.divided(y)
            if quotient is not None:
                return quotient
        if op == "mod" and y.is_constant and y.constant_term and x.divided(y) is not None:
            return Poly.constant(0)  # every coefficient divides: no remainder at any point
    return Node(op, (x, y))


# -- compiling many expressions into one function of the symbols ---------------------------

_NAMESPACE = {
    "__builtins__": {e.__name__: e for e in (ZeroDivisionError, OverflowError, ValueError)},
    **{f"_{name}": fn for name, fn in OPERATIONS.items()},
}


class _Emitter:
    """Python source for expressions, each sub-expression assigned once (``t3 = ...``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._names: dict[Any, str] = {}

    def of(self, value: Any) -> str:
        if isinstance(value, float):  # repr round-trips a finite float exactly
            return repr(value) if math.isfinite(value) else f"_float({str(value)!r})"
        if not isinstance(value, (Poly, Node)):
            return repr(value)
        name = self._names.get(value)
        if name is None:
            if isinstance(value, Poly):
                text = value.source()
            else:
                args = ", ".join(self.of(a) for a in value.args)
                text = f"_{value.op}({args})"
            name = self._names[value] = f"t{len(self._names)}"
            self.lines.append(f"    {name} = {text}")
        return name


def _function(
    symbols: Iterable[str], lines: list[str], result: str, failed: bool | None
) -> Callable[..., Any]:
    """``def _f(<symbols>): <lines>; return <result>``: where the numbers raise (a size
    that divides by zero at that point), ``failed`` is the answer, or (None) the error
    is raised as the same code run at that point raises it."""
    names = sorted(symbols)
    if failed is None:
        body = [*lines, f"    return {result}"]
    else:
        body = ["    try:", *(f"    {line}" for line in lines), f"        return {result}"]
        body += [
            "    except (ZeroDivisionError, OverflowError, ValueError):",
            f"        return {failed!r}",
        ]
    source = "\n".join([f"def _f({', '.join(names)}):", *body])
    namespace = dict(_NAMESPACE, _float=float)
    exec(compile(source, "<torchroof.records.dims>", "exec"), namespace)  # noqa: S102
    return cast(Callable[..., Any], namespace["_f"])


def compile_values(exprs: Iterable[Any], symbols: Iterable[str]) -> Callable[..., tuple[Any, ...]]:
    """One Python function of the symbols (keywords) that returns the expressions' values,
    in order: the same integer and float operations as :func:`evaluate`, generated once
    (raising what they raise at the numbers given)."""
    emit = _Emitter()
    items = [emit.of(e) for e in exprs]
    return _function(symbols, emit.lines, f"({', '.join(items)}{',' if items else ''})", None)


def compile_check(decisions: Iterable[Decision], symbols: Iterable[str]) -> Callable[..., bool]:
    """One Python function of the symbols (keywords) that is True when every decision
    comes out as it was taken."""
    emit = _Emitter()
    tests = []
    for d in decisions:
        lhs, rhs = emit.of(d.lhs), emit.of(d.rhs)
        test = f"({lhs} {d.relation} {rhs})"
        tests.append(test if d.holds else f"(not {test})")
    body = " and ".join(tests) or "True"
    return _function(symbols, emit.lines, body, False)


__all__ = [
    "OPERATIONS",
    "Decision",
    "Decisions",
    "Expr",
    "Node",
    "Poly",
    "Relation",
    "combined",
    "compare",
    "compile_check",
    "compile_values",
    "deciding",
    "evaluate",
    "note",
]
