"""Small modules and short functions: the sizes the developer guide promises.

At most a dozen modules at the top of torchroof/ (the rest live in the folders of the data
flow), no module above 600 lines, no function whose body (its statements after the
docstring; a long keyword list is its signature, not its body) is above 80 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    p
    for folder in ("torchroof", "counters", "hardware")
    for p in (ROOT / folder).rglob("*.py")
    if "__pycache__" not in p.parts
)
MAX_MODULE_LINES = 600
MAX_BODY_LINES = 80


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = node.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    end = node.end_lineno or body[-1].lineno
    return end - body[0].lineno + 1


def test_body_lines_counts_statements_not_the_signature_or_docstring() -> None:
    source = 'def f(\n    a,\n    b,\n):\n    """Doc\n    more."""\n    x = a\n    return x\n'
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.FunctionDef)
    assert body_lines(node) == 2  # `x = a` and `return x`; four signature lines, two of doc


def test_at_most_a_dozen_modules_at_the_top() -> None:
    top = sorted(p.name for p in (ROOT / "torchroof").glob("*.py"))
    assert "api.py" in top
    assert len(top) <= 12, top


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_its_functions_are_small(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
    long = [
        f"{node.name} ({body_lines(node)} lines, from line {node.lineno})"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and body_lines(node) > MAX_BODY_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: {long}"
