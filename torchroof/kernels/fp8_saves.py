"""fp8 linear layers' saved inputs as Transformer Engine keeps them: in fp8, not in bf16.

A tensorwise-scaled fp8 linear layer casts its bf16 input to fp8 for the forward GEMM.
torchao's ``Float8Linear`` saves the bf16 input and casts it again in the backward, and the
trace records exactly that. Transformer Engine saves the cast input instead, keeping only
its column-wise (transposed) fp8 data for the weight-gradient GEMM (NVIDIA/TransformerEngine
``transformer_engine/pytorch/module/linear.py``, ``_Linear.forward``: "Discard row-wise data
since it is not needed in backward pass", then ``saved_inputmat = inputmat``), one byte per
element where bf16 takes two.

With ``PricingOptions.save_fp8_inputs`` a bf16 input that only fp8 linear layers read in the
backward (their re-casts) is held from its last forward use to its last backward use at
fp8's size (:class:`torchroof.report.memory.Residency`'s ``narrowed``). Where it is a
sequence-parallel input re-gathered in the backward, its shard, the re-gathered copy and the
re-gather's bytes are fp8's too. An input another op's backward also reads (attention's
output, which flash attention's backward reads in bf16) stays whole. The backward's re-cast
kernels are still priced (Transformer Engine reads its saved fp8 copy instead: a few
memory-bound kernels per layer fewer).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, dtype_itemsize

SCALED_MM = "aten._scaled_mm.default"
FP8_BYTES = 1
WIDE = ("bfloat16", "float16")


def fp8_saved_inputs(ops: Sequence[OpRecord]) -> dict[int, TensorMeta]:
    """Storage -> the input Transformer Engine keeps in fp8 for the backward: every bf16 or
    fp16 input that forward fp8 GEMMs cast, whose every backward reader is one of those
    layers (this module's docstring)."""
    producer: dict[int, OpRecord] = {}
    for op in ops:
        if op.phase == "forward":
            for t in op.outputs:
                producer.setdefault(t.storage, op)
    cast_by: dict[int, set[str]] = {}
    wide: dict[int, TensorMeta] = {}
    for op in ops:
        if op.phase != "forward" or op.name != SCALED_MM or not op.inputs:
            continue
        source = _cast_source(op.inputs[0], op.module, producer)
        if source is not None:
            cast_by.setdefault(source.storage, set()).add(op.module)
            wide[source.storage] = source
    readers: dict[int, set[str]] = {}
    for op in ops:
        if op.phase == "backward":
            for t in op.inputs:
                if t.storage in cast_by:
                    readers.setdefault(t.storage, set()).add(op.module)
    return {
        storage: wide[storage]
        for storage, modules in cast_by.items()
        if readers.get(storage) and readers[storage] <= modules
    }


def fp8_divisor(tensor: TensorMeta) -> int:
    """How many times ``tensor``'s bytes its fp8 copy divides into (bf16: 2). Whole, so
    that a size that is an expression of the batch and length stays one."""
    return dtype_itemsize(tensor.dtype) // FP8_BYTES


def fp8_line(saved: dict[int, TensorMeta]) -> str:
    """The estimate's statement of the inputs saved in fp8 (one line)."""
    wide = sum(t.nbytes for t in saved.values())
    narrow = sum(t.nbytes // fp8_divisor(t) for t in saved.values())
    return (
        f"fp8: {len(saved)} inputs of fp8 linear layers are saved for the backward in fp8 "
        f"({narrow / 2**20:,.2f} MiB, not {wide / 2**20:,.2f} MiB in bf16), as Transformer "
        "Engine saves them"
    )


def _cast_source(
    operand: TensorMeta, module: str, producer: dict[int, OpRecord]
) -> TensorMeta | None:
    """The bf16 or fp16 tensor the fp8 ``operand`` of a GEMM in ``module`` was cast from: up
    its chain of producers inside ``module`` (each step the largest input, not a scale),
    to the first tensor made outside it; None when the chain does not start from one."""
    tensor = operand
    seen = {tensor.storage}
    while True:
        op = producer.get(tensor.storage)
        if op is None or op.module != module or not op.inputs:
            return None
        tensor = max(op.inputs, key=lambda t: t.numel)
        if tensor.storage in seen:  # a view of what no op made: the chain has no start
            return None
        seen.add(tensor.storage)
        made_by = producer.get(tensor.storage)
        if made_by is None or made_by.module != module:
            return tensor if tensor.dtype in WIDE else None
