"""Quantised linear layers: the recipes people train and serve with, applied to the
real model before it is traced, so the trace holds the kernels a GPU launches for them.

Narrowing the datatype doubles pi (the datasheets' per-datatype tensor peaks) and leaves beta
alone, so it moves the ridge; for decode it scales s and pi together, so B* does not move.

Each recipe is the library people use where it runs on meta (torchao 0.18):

- ``fp8`` / ``fp8-rowwise``: a training step runs torchao's ``convert_to_float8_training``
  (tensorwise or rowwise dynamic scaling: the amax reductions, scale computation and casts,
  and ``_scaled_mm`` on the fp8 tensor cores with a bf16 output); a serving step runs
  torchao's ``Float8DynamicActivationFloat8WeightConfig`` (per-tensor or per-row
  granularity: fp8 weights, each activation quantised by an amax and a cast, then
  ``_scaled_mm``). torchao refuses the serving config without a CUDA device of compute
  capability 8.9; torchroof prices a chosen accelerator, so that check is replaced by its
  own (:func:`check_hardware`).
- ``int8-weight`` / ``fp8-weight``: torchao's ``Int8WeightOnlyConfig`` /
  ``Float8WeightOnlyConfig`` (per-channel scales). On meta torchao dequantises the weight and
  runs a bf16 matmul; the fused policy folds that dequantisation into the matmul
  (:mod:`torchroof.kernels.fusion`, the mixed-input GEMM of gpt-fast, Marlin, TensorRT-LLM), so the
  weight is read at its stored width.
- ``int4-weight``, ``mxfp4-weight``, ``nvfp4``: torchao's kernels for these need packages or
  GPUs that are not here (``Int4WeightOnlyConfig`` needs mslk; NVFP4's activation
  quantisation needs triton; MXFP4's fp4 ``_scaled_mm`` meta check rejects the packed
  scales), so the same kernels are registered ops priced by a rule
  (:mod:`torchroof.quant.packed_weights`).

Linear layers inside the decoder are quantised; the LM head and embeddings keep the model's
dtype (torchtitan's Float8 filter and TensorRT-LLM's default), and so do latent attention's
``kv_b_proj`` (absorbed decoding reads its weight directly) and MoE experts held as 3-D
grouped-GEMM weights (not ``nn.Linear``), said in the report; so does a layer whose shape
does not fit the recipe's scale groups (named in the report).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from torchroof.config.choices import NO_QUANT
from torchroof.config.errors import WorkloadError
from torchroof.hardware import UnsupportedDtypeError
from torchroof.quiet import quiet_imports as narrow_quiet_imports

KV_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}

# torchao's ``filter_fn(module, fqn)``: the linear layers a recipe quantises
FilterFn = Callable[[torch.nn.Module, str], bool]


@dataclass(frozen=True)
class Recipe:
    """One quantisation recipe: whether a training or a serving step can use it, the tensor
    core its GEMMs run on (a spec key: ``fp8``, ``fp4``; ``""`` for weight-only recipes,
    which compute in the model's dtype), what it does, for the report, and how it is
    applied (``transform(model, filter_fn, trains)``: the library's own transform on the
    linear layers ``filter_fn`` accepts).

    Adding a recipe is its ``Recipe`` in :data:`RECIPES`, its name in
    :data:`torchroof.config.choices.RECIPE_TRAINS` (tests/test_extension_points.py holds the
    two equal), and its tests."""

    name: str
    trains: bool
    serves: bool
    tensor_dtype: str
    describe: str
    transform: Callable[[torch.nn.Module, FilterFn, bool], None]
    block: int = 16  # in_features must be a multiple (scale groups; the GEMMs' alignment)

    def apply(self, model: torch.nn.Module, filter_fn: FilterFn, trains: bool) -> None:
        """Quantise, in place, the linear layers of ``model`` that ``filter_fn`` accepts."""
        with quiet_imports():
            self.transform(model, filter_fn, trains)

    def validate(self, tensor_flops: dict[str, Any], display_name: str) -> None:
        """A clear error before tracing when the accelerator has no tensor cores for the
        recipe's GEMMs (fp8 on an A100, fp4 on an H100)."""
        if not self.tensor_dtype or self.tensor_dtype in tensor_flops:
            return
        weight_only = ", ".join(r.name for r in RECIPES.values() if not r.tensor_dtype)
        raise UnsupportedDtypeError(
            f"quant={self.name!r} runs its GEMMs on {self.tensor_dtype} tensor cores, which "
            f"the {display_name} does not have (it has: {', '.join(sorted(tensor_flops))}); "
            f"weight-only recipes compute in the model's dtype there: {weight_only}"
        )


def _float8(model: torch.nn.Module, filter_fn: FilterFn, trains: bool, rowwise: bool) -> None:
    """torchao's Float8: its training layers for a step that trains (their own filter),
    else its serving config (fp8 weights and dynamically quantised activations)."""
    if trains:
        float8_training(model, "rowwise" if rowwise else "tensorwise")
    else:
        _torchao_serving(model, "fp8-rowwise" if rowwise else "fp8", filter_fn)


def _serving(quant: str) -> Callable[[torch.nn.Module, FilterFn, bool], None]:
    """torchao's serving config of ``quant`` (weight-only recipes: no training form)."""
    return lambda model, filter_fn, _trains: _torchao_serving(model, quant, filter_fn)


def _packed(quant: str) -> Callable[[torch.nn.Module, FilterFn, bool], None]:
    """torchroof's registered packed-weight ops (:mod:`torchroof.quant.packed_weights`)."""

    def transform(model: torch.nn.Module, filter_fn: FilterFn, _trains: bool) -> None:
        from torchroof.quant.packed_weights import apply_packed_weights

        apply_packed_weights(model, quant, filter_fn)

    return transform


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "fp8",
            True,
            True,
            "fp8",
            "fp8 e4m3 GEMMs with per-tensor dynamic scales (torchao Float8, tensorwise)",
            lambda model, filter_fn, trains: _float8(model, filter_fn, trains, rowwise=False),
        ),
        Recipe(
            "fp8-rowwise",
            True,
            True,
            "fp8",
            "fp8 e4m3 GEMMs with per-row dynamic scales (torchao Float8, rowwise)",
            lambda model, filter_fn, trains: _float8(model, filter_fn, trains, rowwise=True),
        ),
        Recipe(
            "int8-weight",
            False,
            True,
            "",
            "int8 weights with per-channel scales, dequantised inside the GEMM "
            "(torchao Int8WeightOnlyConfig)",
            _serving("int8-weight"),
        ),
        Recipe(
            "fp8-weight",
            False,
            True,
            "",
            "fp8 e4m3 weights with per-channel scales, dequantised inside the GEMM "
            "(torchao Float8WeightOnlyConfig)",
            _serving("fp8-weight"),
        ),
        Recipe(
            "int4-weight",
            False,
            True,
            "",
            "int4 weights packed two per byte, bf16 scale and zero per group of 128, "
            "dequantised inside the GEMM (registered op: torchao's int4 kernel needs mslk)",
            _packed("int4-weight"),
            block=128,
        ),
        Recipe(
            "mxfp4-weight",
            False,
            True,
            "",
            "MXFP4 weights (e2m1 packed two per byte, one e8m0 scale per 32), dequantised "
            "inside the GEMM (registered op)",
            _packed("mxfp4-weight"),
            block=32,
        ),
        Recipe(
            "nvfp4",
            False,
            True,
            "fp4",
            "NVFP4 weights and activations (e2m1, one e4m3 scale per 16 and a static fp32 "
            "tensor scale, as TensorRT-LLM calibrates it) on fp4 tensor cores (registered "
            "ops: torchao's kernel needs triton; its dynamic per-tensor amax, a further pass "
            "over each activation, is not modelled)",
            _packed("nvfp4"),
        ),
    )
}


def check_hardware(quant: str, tensor_flops: dict[str, Any], display_name: str) -> None:
    """A clear error before tracing when the accelerator has no tensor cores for the
    recipe's GEMMs (fp8 on an A100, fp4 on an H100): :meth:`Recipe.validate`."""
    recipe = RECIPES.get(quant)
    if recipe is not None:
        recipe.validate(tensor_flops, display_name)


# -- applying a recipe ----------------------------------------------------------------------


# Linear layers a recipe leaves alone: the LM head and embedding projections (torchtitan's
# Float8 filter, TensorRT-LLM's default), MoE routers (vLLM keeps the gate wide), and layers
# whose weight the model reads directly rather than through their forward: Mamba's dt_proj,
# and latent attention's kv_b_proj when decode absorbs it (torchroof/models/mla.py).
_KEPT_WIDE = ("lm_head", "output", "embed_out", "gate", "router", "dt_proj")
ABSORBED_MLA_WIDE = ("kv_b_proj",)


def decoder_linear(
    module: torch.nn.Module, fqn: str, wide: tuple[str, ...] = ()
) -> TypeGuard[torch.nn.Linear]:
    """A plain linear layer inside the decoder (a subclass such as a router keeps its own
    forward), not one of :data:`_KEPT_WIDE` or ``wide``."""
    if type(module) is not torch.nn.Linear:
        return False
    leaf = fqn.rsplit(".", 1)[-1]
    return leaf not in _KEPT_WIDE + wide and "embed" not in leaf


def _fits(module: torch.nn.Linear, block: int) -> bool:
    """Dimensions the recipe's GEMM takes: in_features a multiple of its scale group,
    out_features a multiple of 16 (the fp8 and fp4 GEMMs' alignment), as the weight holds
    them (a tensor-parallel shard's: its rank quantises what it holds)."""
    out_features, in_features = module.weight.shape
    return in_features % block == 0 and out_features % 16 == 0


@dataclass(frozen=True)
class Quantised:
    """What a recipe changed: the linear layers it quantised, those inside the decoder it
    left in the model's dtype because their shapes do not fit its blocks, and the MoE expert
    weights it packed (``experts_kept``: why they were not, when there are some)."""

    recipe: str
    layers: int
    skipped: tuple[str, ...] = ()
    experts: int = 0
    experts_kept: str = ""
    wide: tuple[str, ...] = ()  # layers kept wide by name (kv_b_proj for absorbed MLA)

    def describe(self) -> str:
        """The report's line (empty when nothing was quantised)."""
        if not self.layers and not self.experts:
            return ""
        recipe = RECIPES[self.recipe]
        line = f"the decoder's linear layers: {recipe.describe}"
        if self.skipped:
            line += (
                f"; {len(self.skipped)} left in the model's dtype (in_features not a multiple "
                f"of {recipe.block}, out_features of 16: e.g. {self.skipped[0]})"
            )
        if self.experts:
            line += (
                f"; {self.experts} 3-D MoE expert weights in the same format, read by one "
                "grouped GEMM each (torchroof/quant/packed_experts.py)"
            )
        if self.experts_kept:
            line += f"; MoE experts kept in the model's dtype: {self.experts_kept}"
        if self.wide:
            line += f"; {', '.join(self.wide)} kept wide (absorbed MLA decode reads its weight)"
        return line


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """torchao logs at import about the CUDA extensions a CPU build cannot load, and torch
    about the enums it registers; neither concerns a trace on meta. Only those lines are
    dropped (:func:`torchroof.quiet.quiet_imports`); any other warning or log line shows."""
    with narrow_quiet_imports():
        yield


def float8_training(model: torch.nn.Module, recipe: str) -> None:
    """torchao's Float8 training layers (``tensorwise`` or ``rowwise`` scaling) in place of
    the decoder's linear layers of ``model``."""
    with quiet_imports():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=_filter(16))


def _torchao_serving(model: torch.nn.Module, quant: str, filter_fn: FilterFn) -> None:
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        PerRow,
        PerTensor,
        quantize_,
    )

    configs: dict[str, Callable[[], Any]] = {
        "fp8": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
        "fp8-rowwise": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        "int8-weight": Int8WeightOnlyConfig,
        "fp8-weight": Float8WeightOnlyConfig,
    }
    original = quant_api._check_hardware_support
    # torchao asks for a local CUDA device of capability >= 8.9; the accelerator priced is
    # checked by check_hardware instead.
    quant_api._check_hardware_support = lambda *_: None
    try:
        quantize_(model, configs[quant](), filter_fn=filter_fn)
    finally:
        quant_api._check_hardware_support = original


def _filter(block: int, wide: tuple[str, ...] = ()) -> FilterFn:
    """torchao's ``filter_fn(module, fqn)``: the decoder's linear layers that fit ``block``."""
    return lambda module, fqn: decoder_linear(module, fqn, wide) and _fits(module, block)


def quantize_model(
    model: torch.nn.Module,
    quant: str,
    trains: bool,
    wide: tuple[str, ...] = (),
) -> Quantised:
    """Apply ``quant`` to the decoder's linear layers of ``model`` (on meta, in place); a
    layer whose shape does not fit the recipe's blocks keeps the model's dtype and is named
    in the result. A serving recipe also packs the 3-D weights of grouped-GEMM MoE experts
    (:mod:`torchroof.quant.packed_experts`): under tensor or expert parallel, once sharded,
    each rank's (:func:`torchroof.parallel.quantised_shards.quantize_shards`). Linear
    layers named in ``wide`` keep the model's dtype (:data:`ABSORBED_MLA_WIDE` for a decode
    step that absorbs latent attention). ``none`` changes nothing."""
    if quant == NO_QUANT:
        return Quantised(quant, 0)
    recipe = RECIPES[quant]
    block = recipe.block
    candidates = [(fqn, m) for fqn, m in model.named_modules() if decoder_linear(m, fqn, wide)]
    kept = sorted(
        {fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules() if type(m) is torch.nn.Linear}
        & set(wide)
    )
    skipped = tuple(fqn for fqn, m in candidates if not _fits(m, block))
    if len(skipped) == len(candidates):
        raise WorkloadError(
            f"quant={quant!r}: {type(model).__name__} has no linear layer inside its decoder "
            f"whose in_features is a multiple of {block} and out_features of 16"
        )
    recipe.apply(model, _filter(block, wide), trains)
    experts, experts_kept = _quantise_experts(model, quant, trains)
    return Quantised(
        quant, len(candidates) - len(skipped), skipped, experts, experts_kept, tuple(kept)
    )


def _quantise_experts(model: torch.nn.Module, quant: str, trains: bool) -> tuple[int, str]:
    """(expert weights packed, why some were kept wide: "" when none were)."""
    from torchroof.quant.packed_experts import (
        experts_implementation,
        has_experts,
        other_expert_weights,
        pack_experts,
    )

    if not has_experts(model):
        return 0, ""
    if trains:
        return (
            0,
            "Float8 training converts nn.Linear layers only (torchao's MoE recipe is not used)",
        )
    if experts_implementation(model) != "grouped_mm":
        return 0, f"the model runs its experts as {experts_implementation(model)!r}, not grouped_mm"
    packed, skipped = pack_experts(model, quant)
    reasons = []
    if skipped:
        reasons.append(f"{len(skipped)} whose K does not divide into the groups ({skipped[0]})")
    others = other_expert_weights(model)
    if others:
        reasons.append(
            f"{len(others)} not held as transformers' grouped-GEMM expert weights ({others[0]})"
        )
    return packed, "; ".join(reasons)
