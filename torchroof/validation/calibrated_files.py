"""A shipped (or the user's) hardware or cluster TOML rewritten with fitted figures.

The file is edited line by line, so every figure the fit did not touch keeps its value, its
source and its comment: the top-level ``name``, ``display_name`` and ``aliases`` are
replaced (a calibrated file is its own accelerator or cluster, found by its path), and
each fitted figure's line is replaced in its table, or added at the table's top where the
file had none. Every TOML file torchroof ships writes one figure per line
(``key = { value = ..., source = "..." }``), which is what this relies on.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class Fitted:
    """One figure to write: its value and where it came from."""

    value: float
    source: str

    def toml(self) -> str:
        return f"{{ value = {self.value:.6g}, source = {json.dumps(self.source)} }}"


def _header(line: str) -> str | None:
    match = re.match(r"\s*\[([A-Za-z0-9_.]+)\]\s*(#.*)?$", line)
    return match[1] if match else None


def rewrite(
    text: str,
    name: str,
    display_name: str,
    figures: Mapping[tuple[str, str], Fitted],
    strings: Mapping[str, str] | None = None,
) -> str:
    """``text`` (a TOML file) with its name, display name and aliases replaced, each
    ``figures[(table, key)]`` written in ``table`` ("" for the top level), and each top-level
    string key in ``strings`` (a cluster's ``accelerator``) replaced."""
    top = {
        "name": json.dumps(name),
        "display_name": json.dumps(display_name),
        "aliases": "[]",
        **{k: json.dumps(v) for k, v in (strings or {}).items()},
    }
    wanted: dict[str, dict[str, str]] = {"": dict(top)}
    for (table, key), fitted in figures.items():
        wanted.setdefault(table, {})[key] = fitted.toml()
    out: list[str] = []
    table = ""
    pending = dict(wanted.get("", {}))

    def flush(at: str) -> None:
        """Write the keys of table ``at`` the file did not hold, before leaving it."""
        for key, value in pending.items():
            out.append(f"{key} = {value}")
        pending.clear()

    for line in text.splitlines():
        header = _header(line)
        if header is not None:
            flush(table)
            table = header
            out.append(line)
            pending.update(wanted.get(table, {}))
            continue
        found = re.match(r"\s*([A-Za-z0-9_]+)\s*=", line)
        if found and found[1] in pending:
            out.append(f"{found[1]} = {pending.pop(found[1])}")
            continue
        out.append(line)
    flush(table)
    missing = [t for t in wanted if t and not any(_header(x) == t for x in text.splitlines())]
    for t in missing:  # a table the file lacks: added at the end with its keys
        out += ["", f"[{t}]", *(f"{k} = {v}" for k, v in wanted[t].items())]
    return "\n".join(out) + "\n"


class CalibratedFileError(ValueError):
    """A rewritten file that would not load, or lost a fitted figure; the message says why."""


def checked(
    text: str, figures: Mapping[tuple[str, str], Fitted], beside: str | Path, cluster: bool
) -> str:
    """``text`` once it loads as a hardware (or ``cluster``) file, relative paths read
    ``beside`` the file it was made from, and holds every fitted figure: a file the line
    edits could not rewrite (a value spread over several lines) is refused here."""
    from torchroof.hardware.cluster import parse_cluster
    from torchroof.hardware.spec import parse

    try:
        data = tomllib.loads(text)  # the loaders' TOML reader (tomli before Python 3.11)
        parse_cluster(data, beside) if cluster else parse(data, beside)
    except ValueError as error:  # TOMLDecodeError and the loaders' errors are ValueErrors
        raise CalibratedFileError(f"the fitted file would not load: {error}") from None
    for (table, key), fitted in figures.items():
        held = (data.get(table, {}) if table else data).get(key)
        if not isinstance(held, dict) or held.get("value") != float(f"{fitted.value:.6g}"):
            raise CalibratedFileError(
                f"could not write {key} into {Path(beside).name} line by line (a value "
                "spread over several lines?): edit the figures by hand"
            )
    return text
