"""Knobs as dataclass fields, and the CLI flags generated from them (name, help, choices,
default, ``--help`` section)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import MISSING, field, fields
from typing import Any


def knob(
    default: Any,
    help: str,  # noqa: A002 - argparse's word
    *,
    choices: tuple[str, ...] = (),
    flag: str | None = None,
    scale: float = 1.0,
    group: str = "workload",
    off: str = "",
    runtime_sets: bool = False,
) -> Any:
    """A dataclass field with what the CLI needs: its help text, its choices, the
    ``--help`` section it is listed in (a key of :data:`FLAG_GROUPS`), and for a flag in
    other units than the field (``--launch-overhead-us`` for seconds) the name and the
    factor that converts the flag's value to the field's. A boolean's ``help`` says what
    True does and ``off`` what False does, so ``--name`` and ``--no-name`` each say what
    they turn on whichever the default. A boolean a runtime profile sets
    (``runtime_sets``) gets both flags, so that either overrides the profile."""
    meta = {
        "help": help,
        "choices": choices,
        "flag": flag,
        "scale": scale,
        "group": group,
        "off": off,
        "runtime_sets": runtime_sets,
    }
    return field(default=default, metadata=meta)


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}

# The sections of a command's --help the flags are listed in: (title, description).
FLAG_GROUPS = {
    "workload": ("workload", "the model, the hardware and the step to trace"),
    "parallelism": (
        "parallelism",
        "ranks of each kind (one rank is traced and priced); --batch is per rank and per "
        "micro-batch, so the global batch is batch x dp x fsdp x microbatches",
    ),
    "precision": ("precision", "dtypes and quantisation"),
    "pricing": ("pricing", "how ops become kernels and what each kernel costs"),
    "timing": ("timing", "how a kernel's cost becomes time (--mode realistic and its effects)"),
    "output": ("output", "what is printed and which files are written"),
}


def value_type(f: Any) -> type:
    """A field's value type from its annotation (``int | None`` -> int)."""
    return _TYPES[f.type.split("|")[0].strip()]


def flag_name(f: Any) -> str:
    """The CLI flag of field ``f``: its own ``flag``, else ``--`` and its name in kebab case."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _boolean_flag(f: Any, default: bool, help_text: str) -> tuple[str, dict[str, Any], str]:
    """(flag, argparse keywords, help) of a boolean: ``--name`` when it defaults to False,
    ``--no-name`` when it defaults to True (its help: what False does, then the default)."""
    meta = f.metadata
    name = flag_name(f) if not default else "--no-" + f.name.replace("_", "-")
    kwargs = {"action": "store_false" if default else "store_true", "default": default}
    if default:  # --no-name: what False does, then what the default does
        off = meta.get("off") or f"turn off: {help_text}"
        qualifier = help_text.split(": ", 1)[0] + ": "
        if off.startswith(qualifier):  # "realistic: " said once
            help_text = help_text.removeprefix(qualifier)
        help_text = f"{off} (default: {help_text})" if meta.get("off") else off
    return name, kwargs, help_text


def _opposite_flag(f: Any, default: bool) -> tuple[str, dict[str, Any]]:
    """The flag setting a boolean to its non-default value's opposite (``--no-name`` for a
    False default, ``--name`` for a True one), for a boolean a runtime profile may set: it
    turns the profile's setting back, as written."""
    meta = f.metadata
    name = "--no-" + f.name.replace("_", "-") if not default else flag_name(f)
    said = (meta.get("off") or f"turn off: {meta.get('help')}") if not default else meta["help"]
    kwargs = {
        "dest": f.name,
        "action": "store_true" if default else "store_false",
        "default": default,
        "help": f"{said} (over the runtime profile's setting)",
    }
    return name, kwargs


def _value_flag(f: Any, default: Any, help_text: str) -> tuple[str, dict[str, Any], str]:
    """(flag, argparse keywords, help) of a value: its type, choices or metavar, and its
    default shown in the flag's own unit."""
    meta = f.metadata
    name = flag_name(f)
    kwargs: dict[str, Any] = {"type": value_type(f), "default": default}
    if meta.get("choices"):
        kwargs["choices"] = meta["choices"]
    else:  # the flag's own word and unit: --launch-overhead-us US
        kwargs["metavar"] = name.removeprefix("--").replace("-", "_").upper()
    shown = None if default in (None, "") else default
    if meta.get("scale", 1.0) != 1.0 and shown is not None:
        shown = shown / meta["scale"]  # in the flag's unit
    if isinstance(shown, float) and shown.is_integer():
        shown = int(shown)
    if help_text and shown is not None and "default" not in help_text:
        help_text += f" (default {shown})"
    return name, kwargs, help_text


def add_flags(
    parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = (), **overrides: Any
) -> None:
    """One flag per field of ``cls`` (Workload or PricingOptions): ``--name`` with the
    field's help, choices and default; a boolean defaulting to False is ``--name``, one
    defaulting to True is ``--no-name``. ``overrides`` replace a field's argparse keywords
    (``fusion={"choices": None}`` for a comma list)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        default = None if f.default is MISSING else f.default
        help_text = f.metadata.get("help") or ""
        if isinstance(default, bool):
            name, keywords, help_text = _boolean_flag(f, default, help_text)
        else:
            name, keywords, help_text = _value_flag(f, default, help_text)
        kwargs: dict[str, Any] = {"dest": f.name, **keywords}
        kwargs["help"] = help_text or None
        kwargs.update(overrides.get(f.name, {}))
        group = flag_group(parser, f.metadata.get("group", "workload"))
        group.add_argument(name, **{k: v for k, v in kwargs.items() if v is not None})
        if isinstance(default, bool) and f.metadata.get("runtime_sets"):
            opposite, keywords = _opposite_flag(f, default)
            group.add_argument(opposite, **keywords)


def flag_group(parser: argparse.ArgumentParser, key: str) -> Any:
    """The ``--help`` section ``key`` of :data:`FLAG_GROUPS` on ``parser``, made the
    first time it is asked for."""
    title, description = FLAG_GROUPS[key]
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)


def from_flags(args: argparse.Namespace, cls: type, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The field values the flags of :func:`add_flags` parsed, in the fields' units."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in skip or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        scale = f.metadata.get("scale", 1.0)
        values[f.name] = value * scale if scale != 1.0 and value is not None else value
    return values
