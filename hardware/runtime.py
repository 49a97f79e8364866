"""Runtime profiles: what the software that runs a step does, as data
(``hardware/runtimes/*.toml``, a source for every setting and figure).

The same model on the same GPU takes a different time under torchtitan, Megatron with
Transformer Engine, vLLM or plain eager PyTorch: they launch other kernels, launch them
differently, spend their own time on the host between steps and reduce small tensors with
their own all-reduce. A profile says which, and where each claim comes from.

The format, every key a profile may hold (anything else is an error):

- ``name`` (string, required), ``display_name``, ``aliases``, ``source``: as in an
  accelerator file.
- ``runs`` (string, required): ``"training"``, ``"serving"`` or ``"both"``: the steps the
  runtime runs (a serving engine does not train).
- ``[kernels]``: ``fusion`` (setting: ``eager`` or ``fused``), ``epilogue`` (setting: true or
  false), ``loss`` (setting: ``materialized`` or ``chunked``), ``attention`` (setting:
  ``flash`` or ``math``), ``attention_kernel`` (setting: ``fa2``, ``fa3``, ``flashinfer``,
  ``cudnn``, ``trtllm``, ``sdpa``), ``gemm_efficiency`` (figure, optional: the share of
  the tensor peak its GEMM library reaches where published), ``sequence_parallel_regather``
  (setting: true or false: under sequence parallel a linear layer saves the rank's shard
  of its all-gathered input and all-gathers it again in the backward), ``save_fp8_inputs``
  (setting: true or false: an fp8 linear layer saves its input for the backward in fp8),
  ``fp16_accumulate`` (setting: true or false: its fp16 matmuls accumulate in fp16, timed
  against an accelerator's ``fp16_accumulate_tensor_flops_per_s`` where it lists one).
- ``[launches]``: ``kernel_launch_s`` (figure: one kernel launched eagerly),
  ``cuda_graphs`` (setting: ``none``, ``decode`` or ``all``: which steps replay a CUDA
  graph), ``graph_kernel_launch_s`` (figure: one kernel inside a replayed graph),
  ``graph_max_batch`` (figure, whole: the largest decode batch captured),
  ``host_overhead_s`` (figure: host time per step the GPU waits on: scheduling, sampling,
  detokenisation).
- ``[communication]``: ``custom_all_reduce_max_bytes`` (figure, whole: all-reduces below
  this size inside one NVLink or xGMI domain use the runtime's own kernel),
  ``custom_all_reduce_max_ranks`` (figure, whole: the largest group it takes, an even
  number of ranks), ``custom_all_reduce_one_shot_max_bytes`` (figure, whole: below this
  size one shot, every rank reading every peer's buffer; above it two shots),
  ``custom_all_reduce_latency_s`` (figure: its fixed cost), ``tp_comm_overlap`` (setting:
  true or false: under sequence parallel a tensor-parallel all-gather runs in chunks beside
  the GEMM that reads it, and a reduce-scatter beside the GEMM that writes its input).
- ``[defaults]``: ``reshard_after_forward_with_pp`` (setting: true or false: FSDP
  re-gathers parameters for backward when the step is pipelined), ``zero_with_dp``
  (figure, whole: the ZeRO stage a training step over data-parallel replicas runs when
  none is given: 1 for Megatron's distributed optimizer), ``defer_gradient_sync`` (setting:
  true or false: a training step of several micro-batches reduces its gradients once,
  after the last).

A setting is ``{ value = <string or boolean>, source = "<where>" }``; a figure is
``{ value = <number>, source = "<where>", approximate = <bool> }`` as in an accelerator
file. A bad file raises one :class:`RuntimeProfileError` naming the file and every problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from torchroof.hardware.toml_checks import (
    Figure,
    HardwareSpecError,
    ShippedSpecs,
    check_aliases,
    describe,
    parse_figure,
    read_toml,
    unknown_key,
)

RUNTIME_DIR: Traversable = resources.files(__package__).joinpath("runtimes")

RUNS = ("training", "serving", "both")
ATTENTION_KERNELS = ("fa2", "fa3", "flashinfer", "cudnn", "trtllm", "sdpa")
CUDA_GRAPHS = ("none", "decode", "all")
"""Which steps replay a captured CUDA graph: none, decode steps up to ``graph_max_batch``
sequences, or every step."""
SOFTMAX_OVERLAPPED = ("fa3",)
"""Attention kernels that run the softmax of one block under the matmuls of the next
(FlashAttention-3, Shah et al. 2024, section 3.1: ping-pong scheduling and intra-warpgroup
overlap of softmax and GEMM)."""


class RuntimeProfileError(HardwareSpecError):
    """A runtime profile that cannot be used, with every problem found in it."""


class UnknownRuntimeError(KeyError):
    """No runtime profile with that name, alias or path."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Setting:
    """A runtime's choice (a kernel, a policy), with where it is documented."""

    value: str | bool
    source: str


# table -> key -> (kind, choices): kind "setting" (one of choices, or a boolean when the
# choices are ("bool",)), "figure", "whole" (a whole-number figure) or "fraction" (<= 1)
_SCHEMA: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "kernels": {
        "fusion": ("setting", ("eager", "fused")),
        "epilogue": ("setting", ("bool",)),
        "loss": ("setting", ("materialized", "chunked")),
        "attention": ("setting", ("flash", "math")),
        "attention_kernel": ("setting", ATTENTION_KERNELS),
        "sequence_parallel_regather": ("setting", ("bool",)),
        "save_fp8_inputs": ("setting", ("bool",)),
        "fp16_accumulate": ("setting", ("bool",)),
        "gemm_efficiency": ("fraction", ()),
    },
    "launches": {
        "kernel_launch_s": ("figure", ()),
        "cuda_graphs": ("setting", CUDA_GRAPHS),
        "graph_kernel_launch_s": ("figure", ()),
        "graph_max_batch": ("whole", ()),
        "host_overhead_s": ("figure", ()),
    },
    "communication": {
        "custom_all_reduce_max_ranks": ("whole", ()),
        "custom_all_reduce_max_bytes": ("whole", ()),
        "custom_all_reduce_one_shot_max_bytes": ("whole", ()),
        "custom_all_reduce_latency_s": ("figure", ()),
        "tp_comm_overlap": ("setting", ("bool",)),
    },
    "defaults": {
        "reshard_after_forward_with_pp": ("setting", ("bool",)),
        "zero_with_dp": ("whole", ()),
        "defer_gradient_sync": ("setting", ("bool",)),
    },
}
_REQUIRED = {"kernels": ("fusion", "attention_kernel"), "launches": ("kernel_launch_s",)}
_STRING_KEYS = {"name": True, "display_name": False, "source": False, "runs": True}
SCHEMA_KEYS = (*_STRING_KEYS, "aliases", *_SCHEMA)
KERNEL_SETTINGS = (
    "fusion",
    "epilogue",
    "loss",
    "attention",
    "sequence_parallel_regather",
    "save_fp8_inputs",
)
"""The kernels table's settings that are :class:`torchroof.config.PricingOptions` fields
of the same name (the kernel policy the runtime launches)."""


@dataclass(frozen=True)
class RuntimeProfile:
    """One runtime: its kernels, launches, host overhead and small all-reduces."""

    name: str
    display_name: str
    runs: str
    settings: dict[str, Setting] = field(default_factory=dict)  # by key, every table
    figures: dict[str, Figure] = field(default_factory=dict)  # by key, every table
    aliases: tuple[str, ...] = ()
    source: str = ""
    path: str = ""

    def setting(self, key: str) -> str | bool | None:
        """A setting's value, None where the profile does not state it."""
        found = self.settings.get(key)
        return found.value if found is not None else None

    def figure(self, key: str) -> float | None:
        """A figure's value, None where the profile does not state it."""
        found = self.figures.get(key)
        return found.value if found is not None else None

    def kernel_policy(self) -> dict[str, str | bool]:
        """The :class:`~torchroof.config.PricingOptions` kernel fields the runtime sets."""
        return {k: v.value for k, v in self.settings.items() if k in KERNEL_SETTINGS}

    def runs_steps(self, trains: bool) -> bool:
        """Whether the runtime runs steps that train (``trains``) or serve (not)."""
        if self.runs == "both":
            return True
        return trains == (self.runs == "training")

    def graph_replayed(self, regime: str, batch: int, graphs_on: bool = True) -> bool:
        """Whether a step of ``regime`` with ``batch`` sequences replays a CUDA graph (never
        with ``graphs_on`` False: the engine was told to launch eagerly)."""
        if not graphs_on:
            return False
        graphs = self.setting("cuda_graphs") or "none"
        if graphs == "all":
            return True
        limit = self.figure("graph_max_batch")
        return graphs == "decode" and regime == "decode" and (limit is None or batch <= limit)

    def launch_s(self, regime: str, batch: int, graphs_on: bool = True) -> float:
        """One kernel's launch in a step of ``regime`` with ``batch`` sequences: the graph
        figure where the step replays a graph and the profile lists one, else the eager
        launch."""
        graph = self.figure("graph_kernel_launch_s")
        if graph is not None and self.graph_replayed(regime, batch, graphs_on):
            return graph
        eager = self.figure("kernel_launch_s")
        assert eager is not None  # required
        return eager

    def softmax_overlapped(self) -> bool:
        """Whether its attention kernel runs softmax under the matmuls
        (:data:`SOFTMAX_OVERLAPPED`)."""
        return self.setting("attention_kernel") in SOFTMAX_OVERLAPPED


def _setting(key: str, raw: Any, choices: tuple[str, ...], problems: list[str]) -> Setting | None:
    shape = '{ value = <string or boolean>, source = "<where it is documented>" }'
    if not isinstance(raw, dict):
        problems.append(f"{key}: expected a setting {shape}, got {describe(raw)}")
        return None
    before = len(problems)
    for name in raw:
        if name not in ("value", "source"):
            problems.append(f"{key}.{name}: unknown field (a setting has value, source)")
    value = raw.get("value")
    if choices == ("bool",):
        if not isinstance(value, bool):
            problems.append(f"{key}.value: expected true or false, got {describe(value)}")
    elif value not in choices:
        problems.append(f"{key}.value: expected one of {', '.join(choices)}, got {describe(value)}")
    source = raw.get("source")
    if not isinstance(source, str) or not source.strip():
        problems.append(f"{key}.source: missing (every setting names where it is documented)")
    if len(problems) > before:
        return None
    return Setting(value, str(source))  # type: ignore[arg-type]  # checked above


def _table(
    table: str,
    raw: Any,
    settings: dict[str, Setting],
    figures: dict[str, Figure],
    problems: list[str],
) -> None:
    if not isinstance(raw, dict):
        problems.append(f"[{table}]: expected a table, got {describe(raw)}")
        return
    schema = _SCHEMA[table]
    for key, value in raw.items():
        dotted = f"{table}.{key}"
        if key not in schema:
            problems.append(unknown_key(dotted, [f"{table}.{k}" for k in schema]))
            continue
        kind, choices = schema[key]
        if kind == "setting":
            found = _setting(dotted, value, choices, problems)
            if found is not None:
                settings[key] = found
            continue
        figure = parse_figure(dotted, value, kind == "whole", "", problems)
        if figure is None:
            continue
        if kind == "fraction" and figure.value > 1:
            problems.append(f"{dotted}.value: a share of peak is at most 1, got {figure.value!r}")
            continue
        if key == "zero_with_dp" and figure.value not in (0, 1, 2, 3):
            problems.append(f"{dotted}.value: a ZeRO stage is 0, 1, 2 or 3, got {figure.value!r}")
            continue
        figures[key] = figure
    for key in _REQUIRED.get(table, ()):
        if key not in raw:
            problems.append(f"{table}.{key}: required key is missing")


def _consistent(settings: dict[str, Setting], figures: dict[str, Figure]) -> list[str]:
    """Problems between keys: a graph launch without graphs, a one-shot limit above the
    custom all-reduce's, a custom all-reduce without its latency."""
    problems = []
    graphs = settings.get("cuda_graphs")
    uses_graphs = graphs is not None and graphs.value != "none"
    if uses_graphs and "graph_kernel_launch_s" not in figures:
        problems.append("launches.graph_kernel_launch_s: required where cuda_graphs is not none")
    if not uses_graphs and ("graph_kernel_launch_s" in figures or "graph_max_batch" in figures):
        problems.append("launches.cuda_graphs: graph figures are given but cuda_graphs is none")
    custom = [k for k in figures if k.startswith("custom_all_reduce")]
    needed = {
        "custom_all_reduce_max_bytes",
        "custom_all_reduce_max_ranks",
        "custom_all_reduce_latency_s",
    }
    if custom and not needed <= set(figures):
        problems.append(
            "communication: a custom all-reduce needs custom_all_reduce_max_bytes, "
            "custom_all_reduce_max_ranks and custom_all_reduce_latency_s"
        )
    one_shot = figures.get("custom_all_reduce_one_shot_max_bytes")
    limit = figures.get("custom_all_reduce_max_bytes")
    if one_shot is not None and limit is not None and one_shot.value > limit.value:
        problems.append(
            "communication.custom_all_reduce_one_shot_max_bytes: above custom_all_reduce_max_bytes"
        )
    return problems


def parse_runtime(data: dict[str, Any], path: str | Path = "<runtime profile>") -> RuntimeProfile:
    """Check a parsed runtime profile as a whole; :class:`RuntimeProfileError` lists every
    problem."""
    problems: list[str] = []
    strings: dict[str, str] = {}
    aliases: tuple[str, ...] = ()
    settings: dict[str, Setting] = {}
    figures: dict[str, Figure] = {}
    for key, raw in data.items():
        if key in _STRING_KEYS:
            if not isinstance(raw, str) or not raw.strip():
                problems.append(f"{key}: expected a non-empty string, got {describe(raw)}")
            else:
                strings[key] = raw
        elif key == "aliases":
            aliases = check_aliases(raw, problems)
        elif key in _SCHEMA:
            _table(key, raw, settings, figures, problems)
        else:
            problems.append(unknown_key(key, SCHEMA_KEYS))
    problems += [
        f"{key}: required key is missing"
        for key, needed in _STRING_KEYS.items()
        if needed and key not in data
    ]
    problems += [
        f"[{table}]: required table is missing" for table in _REQUIRED if table not in data
    ]
    if strings.get("runs", RUNS[0]) not in RUNS:
        problems.append(f"runs: expected one of {', '.join(RUNS)}, got {strings['runs']!r}")
    problems += _consistent(settings, figures)
    if problems:
        raise RuntimeProfileError(path, problems)
    return RuntimeProfile(
        name=strings["name"],
        display_name=strings.get("display_name", strings["name"]),
        runs=strings["runs"],
        settings=settings,
        figures=figures,
        aliases=aliases,
        source=strings.get("source", ""),
        path=str(path),
    )


def load_runtime_file(path: str | Path | Traversable) -> RuntimeProfile:
    """Parse one runtime profile TOML (the format in this module's docstring)."""
    path = Path(path) if isinstance(path, str) else path
    return parse_runtime(read_toml(path, RuntimeProfileError), str(path))


_SHIPPED = ShippedSpecs(RUNTIME_DIR, load_runtime_file, "runtime", UnknownRuntimeError)


def available_runtimes() -> list[RuntimeProfile]:
    """The shipped runtime profiles, sorted by name."""
    return _SHIPPED.sorted_by_name()


def get_runtime(name: str | Path | RuntimeProfile) -> RuntimeProfile:
    """A runtime profile by name (``vllm``), alias or path to a TOML file of one's own."""
    if isinstance(name, RuntimeProfile):
        return name
    return _SHIPPED.find(str(name))
