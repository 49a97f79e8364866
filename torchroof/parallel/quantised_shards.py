"""Serving recipes on tensor- and expert-parallel shards: each rank quantises the shard it
holds.

vLLM and TensorRT-LLM load a quantised checkpoint sharded by their tensor-parallel plan:
each rank holds its shard's codes and scales (vLLM's ``ColumnParallelLinear`` /
``RowParallelLinear`` take the quantisation method's weights already split along the
output or input dimension; docs.vllm.ai, "Quantization"). Here the model is sharded first
by transformers' tensor-parallel plan (:func:`torchroof.parallel.tensor
.apply_tensor_parallel`), then every sharded parameter becomes its rank's local shard and the
recipe quantises those shards (:func:`torchroof.quant.recipes.quantize_model`): a
column-parallel layer's codes are N/tp rows of K, a row-parallel layer's N rows of K/tp with
their scale groups along that K. transformers' inference path runs a sharded linear layer
on local tensors (``should_use_local_tensors``) and all-reduces a row-parallel one's
output, so the trace holds each rank's quantised GEMMs and the same all-reduces as bf16. A
layer the recipe replaces by a packed module gets its style's forward again. Under expert
parallel each rank's E/ep experts (transformers' ``grouped_gemm`` style, dim 0) are packed
the same way, as vLLM's ``FusedMoE`` loads only its rank's experts of an fp8 checkpoint
(docs.vllm.ai, "Expert Parallel Deployment").
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from torchroof.parallel.tensor import TP_STYLES
from torchroof.quant.recipes import Quantised, decoder_linear, quantize_model


def local_shards(model: nn.Module, wide: tuple[str, ...] = ()) -> int:
    """Replace the DTensor parameters of the layers a serving recipe quantises (the
    decoder's linear layers, the grouped-GEMM experts) by their rank's local shards (plain
    parameters, no gradient: a serving step's); the rest stay DTensors for their styles'
    forward (the embeddings, the LM head, every bias). Returns how many were replaced."""
    count = 0
    for fqn, module in model.named_modules():
        if not (decoder_linear(module, fqn, wide) or hasattr(module, "num_experts")):
            continue
        for name, param in list(module._parameters.items()):
            # a bias stays a DTensor: a row-parallel layer adds it to its reduced output
            if isinstance(param, DTensor) and not name.endswith("bias"):
                module._parameters[name] = nn.Parameter(param.to_local(), requires_grad=False)
                count += 1
    return count


def quantize_shards(model: nn.Module, quant: str, wide: tuple[str, ...] = ()) -> Quantised:
    """Quantise the tensor- and expert-parallel shards of ``model`` (sharded by
    :func:`~torchroof.parallel.tensor.apply_tensor_parallel` and
    :func:`~torchroof.parallel.expert.apply_expert_parallel`, on meta) with the serving
    recipe ``quant``: its parameters become local shards, the recipe runs on them, and each
    linear layer it replaced by a packed module is given its tensor-parallel style's
    forward (local inputs, the row-parallel all-reduce)."""
    styles, mesh = getattr(model, TP_STYLES, ({}, None))
    local_shards(model, wide)
    before = dict(model.named_modules())
    quantised = quantize_model(model, quant, trains=False, wide=wide)
    if mesh is None:
        return quantised
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    for name, module in model.named_modules():
        style = styles.get(name)
        replaced = before.get(name)
        if style is None or replaced is None or replaced is module:
            continue
        # what transformers set on the layer it sharded (latent attention's style reads the
        # model's config from it), the forward it installed apart
        for attribute, value in vars(replaced).items():
            if attribute not in vars(module) and not callable(value):
                setattr(module, attribute, value)
        module._hf_quantized_needs_local_tp = True  # transformers' local quantised path
        ALL_PARALLEL_STYLES[style].install_forward(module, mesh)
    return quantised
