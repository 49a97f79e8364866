"""A referee for the ``fused`` policy: ask torch.compile's Inductor which kernels a GPU launches.

``inductor_kernels(fn, inputs)`` compiles ``fn`` with Inductor on the CPU but makes the
scheduler decide fusion with its GPU rules (the Triton/SIMD scheduling and the GPU-only
branches of lowering and fusion), then stops before any code is generated: no GPU, no
``triton`` package and no C++ compiler are needed. What it returns is Inductor's own answer
to "which kernels, moving how many bytes", for the forward graph and (``backward=True``) the
backward graph that AOTAutograd partitions off with its default min-cut partitioner.

How the GPU rules are switched on (all undone when the call returns) is
torchroof/validation/gpu_rules.py (:func:`gpu_scheduling`).

What stays CPU-specific: AOTAutograd traces the CPU flavour of a few ops (SDPA is
``_scaled_dot_product_flash_attention_for_cpu``, whose backward wants its logsumexp copied
into another layout: one small extra kernel per attention backward).

Interception: ``torch.compile`` gets a backend that is Inductor's own ``compile_fx`` with a
wrapping ``inner_compile``; ``Scheduler.codegen`` is replaced for the duration by a
function that records the fused nodes (with ``V.graph`` still live, so sizes resolve) and
raises a private exception, which the wrapper catches. The wrapper then hands AOTAutograd
a copy of the FX graph to run eagerly, so the forward produces real outputs and the
backward graph gets compiled (and intercepted) in turn.

Bytes: per kernel, the buffers read that no member of the kernel produced, and the buffers
written that something outside the kernel (or the graph's output) uses. Each access counts
the elements its index actually touches (a broadcast weight ``[H]`` counts H, a slice counts
the slice); an indirect access (embedding rows, ``x[target]``) counts one element per loop
iteration, at most the buffer. Inductor's own ``get_read_write_buffer_accesses`` charges a
fused node's indirect reads the whole buffer; this does not. An extern kernel (mm, SDPA)
reads each input and writes each output in full.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from unittest import mock

import torch

from torchroof.validation.gpu_rules import gpu_scheduling

__all__ = [
    "InductorKernel",
    "inductor_kernels",
    "summary",
]

PHASES = ("forward", "backward")


@dataclass(frozen=True)
class InductorKernel:
    """One kernel Inductor would launch on a GPU, with the bytes it moves across HBM."""

    phase: str  # "forward" | "backward"
    name: str  # scheduler node name(s), e.g. "op0_op1_op2"
    kind: str  # pointwise | reduction | extern | template | mix_order_reduction | foreach
    bytes_read: int
    bytes_written: int
    origins: tuple[str, ...] = ()  # FX node names the kernel was lowered from, graph order
    ops: tuple[str, ...] = ()  # their aten packets, e.g. ("aten.amax", "aten.exp")
    reads: tuple[tuple[str, int], ...] = field(default=(), compare=False)  # (buffer, bytes)
    writes: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def cpu_only(self) -> bool:
        """A layout copy that exists only because the graph holds the CPU attention op:
        ``_scaled_dot_product_flash_attention_for_cpu_backward`` wants its log-sum-exp in
        another layout than its forward wrote; the GPU flash backward reads it as written."""
        return self.kind == "pointwise" and any(op.endswith("_for_cpu_backward") for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bytes"] = self.bytes
        data["reads"] = [list(r) for r in self.reads]
        data["writes"] = [list(w) for w in self.writes]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InductorKernel:
        return cls(
            phase=data["phase"],
            name=data["name"],
            kind=data["kind"],
            bytes_read=int(data["bytes_read"]),
            bytes_written=int(data["bytes_written"]),
            origins=tuple(data.get("origins", ())),
            ops=tuple(data.get("ops", ())),
            reads=tuple((str(n), int(b)) for n, b in data.get("reads", ())),
            writes=tuple((str(n), int(b)) for n, b in data.get("writes", ())),
        )


def summary(kernels: Sequence[InductorKernel], phase: str | None = None) -> tuple[int, int]:
    """(kernel count, total bytes read + written), over one phase or all of them, without
    the CPU-only layout copies (:attr:`InductorKernel.cpu_only`)."""
    chosen = [k for k in kernels if (phase is None or k.phase == phase) and not k.cpu_only]
    return len(chosen), sum(k.bytes for k in chosen)


class _Abort(Exception):
    """Raised from the scheduler once the fused nodes are recorded: no code is generated."""


# -- reading the scheduler ----------------------------------------------------------------------


def _hint(expr: Any) -> int:
    from torch._inductor.virtualized import V

    return int(V.graph.sizevars.optimization_hint(expr, fallback=0))


def _buffer_extent(name: str) -> tuple[int, int] | None:
    """(numel, itemsize) of a buffer or graph input; a mutation's NoneLayout resolves to the
    buffer it mutates; None for a multi-output holder or anything without a tensor."""
    from torch._inductor import ir
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    graph = V.graph
    for _ in range(8):  # follow mutation chains
        buf = graph.name_to_buffer.get(name) or graph.graph_inputs.get(name)
        if buf is None:
            constant = graph.constants.get(name)
            if isinstance(constant, torch.Tensor):
                return constant.numel(), constant.element_size()
            return None
        if not isinstance(buf, ir.IRNode) or isinstance(buf, ir.TorchBindObject):
            return None
        try:
            layout = buf.get_output_spec() if isinstance(buf, ir.Buffer) else buf.get_layout()
        except (AttributeError, NotImplementedError):
            layout = None
        if isinstance(layout, ir.NoneLayout):
            mutated = buf.get_mutation_names()
            if not mutated:
                return None
            name = mutated[0]
            continue
        if isinstance(layout, ir.MultiOutputLayout):
            return None
        return _hint(math.prod(buf.get_size())), get_dtype_size(buf.get_dtype())
    return None


def _iteration_numel(snode: Any) -> int | None:
    from torch._inductor import scheduler as sched

    if isinstance(snode, sched.SchedulerNode):
        pointwise, reduction = snode.get_ranges()
        return _hint(math.prod(pointwise) * math.prod(reduction))
    return None


def _dep_numel(dep: Any, snode: Any, full: int) -> int:
    """Elements one access touches: the loop variables its index uses (a broadcast or a slice
    touches less than the buffer); an indirect access (gather, scatter) one element per
    iteration of its loop; a whole-buffer dependency of a loop kernel at most one element per
    iteration (Inductor's own rule); an extern kernel's input or output in full."""
    from torch._inductor.dependencies import MemoryDep, StarDep, WeakDep

    if isinstance(dep, WeakDep):
        return 0
    iterations = _iteration_numel(snode)
    if isinstance(dep, StarDep):
        return full if iterations is None else min(full, iterations)
    if isinstance(dep, MemoryDep):
        if dep.is_indirect():
            touched = _hint(math.prod(dep.size)) if dep.size else iterations
            return full if touched is None else min(full, touched)
        return min(full, _hint(dep.get_numel()))
    return full


def _mutated_names(snode: Any) -> set[str]:
    """Buffers ``snode`` writes into in place (a scatter's target)."""
    names: set[str] = set()
    for buf in snode.get_outputs():
        names.update(buf.node.get_mutation_names())
    return names


def _multi_output_children(nodes: Sequence[Any]) -> dict[str, list[str]]:
    """Multi-output extern kernel (SDPA, a fallback returning a tuple) -> its output buffers."""
    from torch._inductor import ir

    children: dict[str, list[str]] = {}
    for node in nodes:
        for snode in node.get_nodes():
            if isinstance(snode.node, ir.MultiOutput) and snode.node.inputs:
                # a MultiOutput's first input is its parent kernel, an IRNode; Inductor types
                # ir.MultiOutput.inputs loosely (IRNode | Sequence[IRNode])
                parent = snode.node.inputs[0].get_name()  # type: ignore[union-attr]
                children.setdefault(parent, []).append(snode.node.get_name())
    return children


def _kind(node: Any) -> str:
    from torch._inductor import scheduler as sched

    if isinstance(node, sched.FusedMixOrderReductions):
        return "mix_order_reduction"
    if isinstance(node, sched.ForeachKernelSchedulerNode):
        return "foreach"
    if isinstance(
        node, (sched.ExternKernelSchedulerNode, sched.FusedExternTritonKernelSchedulerNode)
    ):
        return "extern"
    if node.is_template():
        return "template"
    if node.is_reduction():
        return "reduction"
    return "pointwise"


def _origins(node: Any, order: dict[Any, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """FX nodes the kernel came from (graph order) and their aten packets."""
    from torch._inductor import scheduler as sched

    found: dict[Any, None] = {}
    for snode in node.get_nodes():
        if snode.node is not None:
            for origin in snode.node.get_origins():
                found[origin] = None

    def position(fx_node: Any) -> tuple[int, str]:
        graph = fx_node.graph
        if graph not in order:
            order[graph] = {n: i for i, n in enumerate(graph.nodes)}
        return order[graph].get(fx_node, 1 << 30), fx_node.name

    ranked = sorted(found, key=position)
    targets = [fx_node.target for fx_node in ranked]
    if isinstance(node, sched.ExternKernelSchedulerNode):
        # an extern kernel's origins also name the producers it was handed; its op is its own
        own = getattr(node.node, "op_overload", None)
        origin = getattr(node.node, "origin_node", None)
        if own is None and origin is not None:
            own = origin.target
        if own is not None:
            targets = [own]
    ops: dict[str, None] = {}
    for target in targets:
        packet = getattr(target, "overloadpacket", None)
        ops[str(packet) if packet is not None else str(getattr(target, "__name__", target))] = None
    return tuple(n.name for n in ranked), tuple(ops)


def _kernel(
    node: Any, scheduler: Any, phase: str, children: dict[str, list[str]], order: dict[Any, Any]
) -> InductorKernel | None:
    from torch._inductor import ir
    from torch._inductor import scheduler as sched
    from torch._inductor.dependencies import StarDep
    from torch._inductor.scheduler import OutputNode
    from torch._inductor.virtualized import V

    if isinstance(node, sched.NopKernelSchedulerNode):
        return None
    if isinstance(node, sched.ExternKernelSchedulerNode) and isinstance(node.node, ir.MultiOutput):
        return None  # indexes its parent's outputs: the parent kernel wrote them
    snodes = node.get_nodes()
    members = {id(s) for s in snodes}
    produced = {buf.get_name() for s in snodes for buf in s.get_outputs()}
    for s in snodes:
        produced.update(dep.name for dep in s.read_writes.writes)
    graph_outputs = set(V.graph.get_output_names())
    fused = len(snodes) > 1

    def materialized(name: str) -> bool:
        if not fused or name in graph_outputs or name in V.graph.graph_inputs:
            return True
        buf = scheduler.name_to_buf.get(name)
        if buf is None:
            return True
        return any(
            isinstance(use.node, OutputNode) or id(use.node) not in members for use in buf.users
        )

    def tally(direction: str) -> dict[str, int]:
        accesses: dict[str, dict[Any, Any]] = {}
        for s in snodes:
            deps = s.read_writes.reads if direction == "read" else s.read_writes.writes
            mutated = _mutated_names(s) if direction == "read" else set()
            for dep in deps:
                if direction == "read" and dep.name in produced:
                    continue  # made inside this kernel: never leaves the chip
                if isinstance(dep, StarDep) and dep.name in mutated and dep.mode is None:
                    continue  # ordering on the buffer it scatters into, not a read
                if direction == "write" and not materialized(dep.name):
                    continue
                accesses.setdefault(dep.name, {})[dep] = s
        out: dict[str, int] = {}
        for name, deps in accesses.items():
            if name in children:  # a multi-output holder: its children carry the bytes
                for child in children[name]:
                    extent = _buffer_extent(child)
                    if extent is not None:
                        out[child] = extent[0] * extent[1]
                continue
            extent = _buffer_extent(name)
            if extent is None:
                continue
            full, itemsize = extent
            numel = min(full, sum(_dep_numel(dep, s, full) for dep, s in deps.items()))
            if numel:
                out[name] = numel * itemsize
        return out

    reads, writes = tally("read"), tally("write")
    origins, ops = _origins(node, order)
    return InductorKernel(
        phase=phase,
        name=node.get_name(),
        kind=_kind(node),
        bytes_read=sum(reads.values()),
        bytes_written=sum(writes.values()),
        origins=origins,
        ops=ops,
        reads=tuple(sorted(reads.items())),
        writes=tuple(sorted(writes.items())),
    )


def _collect(scheduler: Any, phase: str) -> list[InductorKernel]:
    children = _multi_output_children(scheduler.nodes)
    order: dict[Any, Any] = {}
    kernels = []
    for node in scheduler.nodes:
        kernel = _kernel(node, scheduler, phase, children, order)
        if kernel is not None:
            kernels.append(kernel)
    return kernels


# -- compiling --------------------------------------------------------------------------------


def _aborted(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, _Abort):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def inductor_kernels(
    fn: torch.nn.Module | Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    backward: bool = False,
) -> list[InductorKernel]:
    """The kernels Inductor schedules for ``fn(*example_inputs)`` under its GPU fusion rules.

    ``fn`` returns one tensor. Without ``backward`` the call runs under ``torch.no_grad()``
    (an inference graph: nothing saved for a backward). With it, ``fn``'s output gets
    ``out.backward(torch.ones_like(out))``; inputs (and parameters) that should get
    gradients must already require them. Forward kernels come first, tagged "forward",
    then the backward graph's, tagged "backward". Nothing is generated or compiled: the
    scheduler's fused nodes are read and the compile is abandoned.
    """
    from torch._inductor import scheduler as sched
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    kernels: list[InductorKernel] = []
    current: list[str] = []

    def record_and_stop(scheduler: Any) -> None:
        kernels.extend(_collect(scheduler, current[-1]))
        raise _Abort

    def inner_compile(gm: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        phase = "backward" if kwargs.get("is_backward") else "forward"
        runnable = copy.deepcopy(gm)  # the inner compile rewrites gm in place
        current.append(phase)
        try:
            compile_fx_inner(gm, inputs, **kwargs)
        except Exception as error:  # noqa: BLE001 - Inductor wraps _Abort in its own error
            if not _aborted(error):
                raise
        else:
            raise RuntimeError("Inductor compiled without reaching the scheduler's codegen")
        finally:
            current.pop()

        def run(args: list[Any]) -> Any:
            return runnable(*args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def backend(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        return compile_fx(gm, inputs, inner_compile=inner_compile)

    torch._dynamo.reset()
    grad = contextlib.nullcontext() if backward else torch.no_grad()
    try:
        with gpu_scheduling(), mock.patch.object(sched.Scheduler, "codegen", record_and_stop):
            with grad:
                out = torch.compile(fn, backend=backend, fullgraph=True)(*example_inputs)
            if backward:
                if not isinstance(out, torch.Tensor):
                    raise TypeError("backward=True needs fn to return one tensor")
                out.backward(torch.ones_like(out))
    finally:
        torch._dynamo.reset()
    order = {phase: i for i, phase in enumerate(PHASES)}
    return sorted(kernels, key=lambda k: order[k.phase])  # stable: schedule order kept
