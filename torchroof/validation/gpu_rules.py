"""Inductor's GPU scheduling rules switched on for the ``cpu`` device, and undone on exit.

How (:func:`gpu_scheduling`; torchroof/validation/referee.py asks the scheduler under it):

- ``config.cpu_backend = "triton"``: the ``cpu`` device gets ``TritonScheduling``, so
  ``can_fuse``, tiling groups and reduction handling are the SIMD (GPU) ones.
- The GPU-only branches that test the device type are pointed at ``cpu`` too:
  ``BaseSchedulerNode.is_gpu/is_cpu`` (loop reordering during fusion, mix-order
  reductions), ``is_gpu``/``is_cpu`` as seen by ``ir`` (loop merging, tiny-reduction
  unrolling, the realize-or-inline thresholds), ``fx_passes.post_grad`` (addmm split so the
  bias joins a pointwise epilogue) and ``decomposition``; ``scheduler._is_gpu_triton_backend``
  accepts ``cpu``; ``SchedulerNode._compute_attrs`` sees ``cpu`` as a GPU for its
  read/write normalisation; zero-dim "CPU scalars" are not special-cased.
- ``DeviceProperties.create`` answers for ``cpu`` with an H100's (132 SMs, warp 32), so
  split-reduction heuristics size for a GPU rather than for this machine's cores.
- Some lowerings and decompositions hard-code a CPU path inside their bodies (``cat``
  always a ``ConcatKernel``, pad-as-cat off, two-step variance thresholds, ``bmm`` turned
  into mul+sum with contiguous inputs, layer-norm statistics kept in the input dtype);
  their code objects are swapped for copies with the CPU test removed (see
  ``_LOWERING_PATCHES``). If the installed torch's source no longer contains the expected
  text, that patch is skipped and named in :data:`GPU_RULE_GAPS`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch

GPU_RULE_GAPS: list[str] = []
"""GPU-only lowering branches this torch's source no longer matched (so CPU rules applied)."""

# DeviceProperties of an H100 SXM, given to Inductor's split-reduction heuristics for "cpu".
_GPU_PROPERTIES = {
    "multi_processor_count": 132,
    "cc": 90,
    "major": 9,
    "regs_per_multiprocessor": 65536,
    "max_threads_per_multi_processor": 2048,
    "max_threads_per_block": 1024,
    "warp_size": 32,
}


def _cpu_as_gpu(original: Callable[[str | None], bool]) -> Callable[[str | None], bool]:
    def is_gpu(device: str | None) -> bool:
        return device == "cpu" or original(device)

    return is_gpu


def _without_cpu_branch(
    func: Callable[..., Any], replacements: Sequence[tuple[str, str]]
) -> types.CodeType | None:
    """A copy of ``func``'s code with each ``old`` source text replaced by ``new``; None (and a
    note in GPU_RULE_GAPS) when the installed source does not contain them."""
    func = inspect.unwrap(func)
    try:
        lines, first = inspect.getsourcelines(func)
    except (OSError, TypeError):
        GPU_RULE_GAPS.append(f"{func.__qualname__}: source unavailable")
        return None
    source = textwrap.dedent("".join(lines))
    for old, new in replacements:
        if old not in source:
            GPU_RULE_GAPS.append(f"{func.__qualname__}: {old!r} not found")
            return None
        source = source.replace(old, new)
    # keep line numbers (tracebacks) and skip the decorators: only the function's own code
    # object is taken from the compiled module, nothing is executed
    module = compile("\n" * (first - 1) + source, func.__code__.co_filename, "exec")
    for const in module.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == func.__name__:
            if const.co_freevars != func.__code__.co_freevars:
                break
            return const
    GPU_RULE_GAPS.append(f"{func.__qualname__}: patched code did not compile to a function")
    return None


_LOWERING_PATCHES: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    # CPU cat is always a ConcatKernel; GPU chooses pointwise_cat when it fuses (RoPE's
    # rotate_half, the cat in a qkv split)
    ("torch._inductor.lowering", "cat"): (
        ('cpu_device = inputs[0].get_device().type == "cpu"', "cpu_device = False"),
    ),
    # right-pad as cat is skipped on CPU only
    ("torch._inductor.lowering", "_pad_as_cat"): (
        ('if device is not None and device.type == "cpu":', "if False:"),
    ),
    # var_mean: CUDA's two-step thresholds instead of the C++ backend's
    ("torch._inductor.lowering", "use_two_step_variance"): (
        ('if device and device.type == "cpu":', "if False:"),
        (
            'device.type == "cuda" and is_triton(x)',
            'device.type in ("cuda", "cpu") and is_triton(x)',
        ),
    ),
    # layer norm saves mean/rstd in the input dtype on CPU, in fp32 on GPU
    ("torch._refs", "native_layer_norm"): (
        ('if input.device.type in ["cpu", "mtia"]:', "if False:"),
    ),
    # bmm: CPU turns every M=1 or N=1 bmm into mul+sum and forces contiguous inputs; CUDA
    # only decomposes dot-shaped bmm
    ("torch._inductor.kernel.bmm", "tuned_bmm"): (
        ('device_type in ("cuda", "xpu")', 'device_type in ("cuda", "xpu", "cpu")'),
        ('if all(x.get_device().type == "cpu" for x in [mat1, mat2]):', "if False:"),
    ),
}
_patched_codes: dict[tuple[str, str], types.CodeType | None] = {}


@contextlib.contextmanager
def _swap_code(func: Callable[..., Any], code: types.CodeType | None) -> Iterator[None]:
    target = inspect.unwrap(func)
    if code is None:
        yield
        return
    saved = target.__code__
    target.__code__ = code
    try:
        yield
    finally:
        target.__code__ = saved


@contextlib.contextmanager
def gpu_scheduling() -> Iterator[None]:
    """Inductor config and patches under which the ``cpu`` device is scheduled with the GPU
    (Triton/SIMD) rules. Undone on exit."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import decomposition, ir
    from torch._inductor import scheduler as sched
    from torch._inductor.fx_passes import post_grad
    from torch._inductor.runtime import hints

    real_props = hints.DeviceProperties.create

    def device_properties(cls: type, device: torch.device) -> Any:
        if torch.device(device).type != "cpu":
            return real_props(device)
        return cls(type="cpu", index=0, **_GPU_PROPERTIES)

    original_compute_attrs = sched.SchedulerNode._compute_attrs

    def compute_attrs(self: Any, *args: Any, **kwargs: Any) -> None:
        # read/write normalisation (loop_ordering_after_fusion) as for a GPU node; the
        # backend is made first, outside the patch (create_backend asserts on GPU indices)
        self.scheduler.get_backend(self.node.get_device_or_error())
        with mock.patch.object(sched, "is_gpu", _cpu_as_gpu(sched.is_gpu)):
            original_compute_attrs(self, *args, **kwargs)

    def both_gpu_triton(node1: Any, node2: Any) -> bool:
        devices = {node1.get_device(), node2.get_device()}
        if any(d is None for d in devices) or len({d.type for d in devices}) != 1:
            return False
        return next(iter(devices)).type in ("cuda", "xpu", "cpu")

    def node_on_gpu(self: Any) -> bool:
        device = self.get_device()
        return device is not None and (device.type == "cpu" or sched.is_gpu(device.type))

    for (module, name), replacements in _LOWERING_PATCHES.items():
        if (module, name) not in _patched_codes:
            function = getattr(importlib.import_module(module), name)
            _patched_codes[module, name] = _without_cpu_branch(function, replacements)

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            inductor_config.patch(
                {
                    "cpu_backend": "triton",
                    "fx_graph_cache": False,  # a cache hit would skip the scheduler
                    "compile_threads": 1,  # no worker pool for kernels never compiled
                    "freezing": False,
                }
            )
        )
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        patches = [
            (sched.BaseSchedulerNode, "is_gpu", node_on_gpu),
            (sched.BaseSchedulerNode, "is_cpu", lambda self: False),
            (sched.Scheduler, "update_zero_dim_cpu_tensor", lambda self: None),
            (sched, "_is_gpu_triton_backend", both_gpu_triton),
            (sched.SchedulerNode, "_compute_attrs", compute_attrs),
            (ir, "is_gpu", _cpu_as_gpu(ir.is_gpu)),
            (ir, "is_cpu", lambda x: False),  # realize heuristics: GPU thresholds
            (post_grad, "is_gpu", _cpu_as_gpu(post_grad.is_gpu)),
            (decomposition, "is_gpu", _cpu_as_gpu(decomposition.is_gpu)),
            (hints.DeviceProperties, "create", classmethod(device_properties)),
        ]
        for owner, attribute, value in patches:
            stack.enter_context(mock.patch.object(owner, attribute, value))
        for (module, name), code in _patched_codes.items():
            stack.enter_context(_swap_code(getattr(importlib.import_module(module), name), code))
        yield
