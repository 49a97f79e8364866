"""Reference cases for the Inductor referee (:mod:`torchroof.validation.referee`).

Each case builds a module and its example inputs on a given device: ``cpu`` (random values)
for Inductor, ``meta`` for torchroof's own trace, so both sides see the same ops. Shapes are
small but realistic (2 x 256 tokens, hidden 512, a 32k vocabulary for the loss) so that every
compile stays within seconds on a small CPU.

``torchroof_fused(case)`` is torchroof's side: the module traced on meta, grouped by the
``fused`` policy. ``examples/inductor_reference.py`` prints both and writes the Inductor side
to ``examples/inductor_reference.json``; ``tests/test_referee.py`` compares against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["CASES", "Case", "case", "torchroof_fused"]

BATCH, SEQ, HIDDEN, INTERMEDIATE = 2, 256, 512, 1536
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
VOCAB = 32000

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Case:
    """A module and inputs to compare on; ``build(device, dtype, grad)`` makes them."""

    name: str
    dtype: torch.dtype
    backward: bool
    build: Callable[[torch.device, torch.dtype, bool], Built]
    note: str = ""

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def phases(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    def make(self, device: str | torch.device) -> Built:
        """Module (eval mode: no dropout) and inputs on ``device``; float inputs and
        parameters require grad when the case includes backward."""
        device = torch.device(device)
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            module, inputs = self.build(device, self.dtype, self.backward)
        module = module.to(device).eval()
        module.requires_grad_(self.backward)
        return module, inputs


def _hidden(device: torch.device, dtype: torch.dtype, grad: bool, *shape: int) -> torch.Tensor:
    shape = shape or (BATCH, SEQ, HIDDEN)
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)


class Layers(nn.Module):
    """Blocks in a ``layers`` ModuleList (paths ``layers.0``, ``layers.1``), run in turn; the
    extra inputs (RoPE cos/sin, a mask) are handed to every block."""

    def __init__(self, blocks: Sequence[nn.Module], **kwargs_of_inputs: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.kwargs_of_inputs = kwargs_of_inputs  # keyword -> index into the extra inputs

    def forward(self, hidden: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if "cos" in self.kwargs_of_inputs:
            kwargs["position_embeddings"] = (extra[0], extra[1])
        if "attention_mask" in self.kwargs_of_inputs:
            kwargs["attention_mask"] = extra[self.kwargs_of_inputs["attention_mask"]]
        for layer in self.layers:
            hidden = layer(hidden, **kwargs)
        return hidden


class LayerNormGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(x))


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


class CrossEntropy(nn.Module):
    """HF-style causal-LM loss on given logits: upcast to fp32, mean cross-entropy."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float(), targets)


# The sizes every decoder case shares (one block: the 2-layer model builds its own blocks).
DECODER_SIZES: dict[str, Any] = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    num_hidden_layers=1,
    vocab_size=VOCAB,
)


def _llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    sizes = {**DECODER_SIZES, "num_hidden_layers": 2, "max_position_embeddings": 4096}
    config = LlamaConfig(**sizes, **overrides)
    config._attn_implementation = "sdpa"
    return config


def _rope(config: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos/sin for positions 0..SEQ-1, as the model computes once and hands every layer."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    cos, sin = rotary(torch.empty(1, device=device, dtype=dtype), positions)
    return cos, sin


def _causal_mask(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.full((SEQ, SEQ), torch.finfo(dtype).min, device=device, dtype=dtype)
    return mask.triu(1)[None, None].expand(BATCH, 1, SEQ, SEQ)


# -- builders --------------------------------------------------------------------------------


def _rmsnorm(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(HIDDEN).to(dtype), (_hidden(device, dtype, grad),)


def _rmsnorm_wide(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    """2 x 4096 tokens at hidden 4096: enough rows for Inductor's mix-order reduction."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(4096).to(dtype), (_hidden(device, dtype, grad, BATCH, 4096, 4096),)


def _layernorm_gelu(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    return LayerNormGelu().to(dtype), (_hidden(device, dtype, grad),)


def _softmax(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    return Softmax(), (_hidden(device, dtype, grad, 1024, 4096),)


def _swiglu_layer(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return Layers([LlamaMLP(_llama_config())]).to(dtype), (_hidden(device, dtype, grad),)


def _llama_mlp(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(_llama_config()).to(dtype), (_hidden(device, dtype, grad),)


def _float8_mlp(recipe: str) -> Callable[..., Built]:
    """A Llama MLP whose three linear layers are torchao's Float8 training layers:
    the amax reductions, scale arithmetic and casts around each ``_scaled_mm``."""

    def build(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
        from torchroof.quant.recipes import float8_training

        module, inputs = _llama_mlp(device, dtype, grad)
        float8_training(module, recipe)
        return module, inputs

    return build


class Int8WeightOnlyLinear(nn.Module):
    """gpt-fast's weight-only int8 linear (torchao's Int8WeightOnlyConfig runs the same ops on
    meta): the int8 weight widened to the activation's dtype, a bf16 GEMM, the per-channel
    scale after it."""

    weight: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        weight = torch.randint(-128, 127, (out_features, in_features), dtype=torch.int8)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", torch.rand(out_features, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype)) * self.scales


def _int8_weight_only(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    """One decode token through a 512 -> 1536 int8 weight-only linear layer."""
    return Int8WeightOnlyLinear(HIDDEN, INTERMEDIATE), (_hidden(device, dtype, grad, 1, HIDDEN),)


def _decoder_layers(layer_class: Any, config: Any, count: int = 1) -> Callable[..., Built]:
    def build(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
        blocks = [layer_class(config, layer_idx=i) for i in range(count)]
        model = Layers(blocks, cos=0, sin=1).to(dtype)
        cos, sin = _rope(config, device, dtype)
        return model, (_hidden(device, dtype, grad), cos, sin)

    return build


def _llama(count: int = 1) -> Callable[..., Built]:
    from torchroof.quiet import quiet_imports

    with quiet_imports():  # transformers' modeling imports torchao, which logs at import
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return _decoder_layers(LlamaDecoderLayer, _llama_config(), count)


def _qwen3(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    config = Qwen3Config(**DECODER_SIZES)
    config._attn_implementation = "sdpa"
    return _decoder_layers(Qwen3DecoderLayer, config)(device, dtype, grad)


def _gemma2(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer

    config = Gemma2Config(
        **DECODER_SIZES,
        layer_types=["full_attention"],
        attn_logit_softcapping=50.0,
    )
    config._attn_implementation = "eager"  # soft-capping needs the eager attention
    model = Layers([Gemma2DecoderLayer(config, layer_idx=0)], cos=0, sin=1, attention_mask=2)
    model = model.to(dtype)
    cos, sin = _rope(config, device, dtype)
    return model, (_hidden(device, dtype, grad), cos, sin, _causal_mask(device, dtype))


def _gpt2(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        n_embd=HIDDEN,
        n_head=HEADS,
        n_layer=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "sdpa"
    return Layers([GPT2Block(config, layer_idx=0)]).to(dtype), (_hidden(device, dtype, grad),)


def _mixtral_moe(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        **{**DECODER_SIZES, "intermediate_size": INTERMEDIATE // 2},
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    # The default "eager" experts loop over nonzero() (data-dependent: no fullgraph compile);
    # "grouped_mm" sorts tokens by expert (sort, histc, cumsum offsets) and runs one
    # torch._grouped_mm per projection, which compiles and is what a GPU runs. ("batched_mm"
    # compiles too but gathers a weight copy per token: 1.6 GB here.)
    config._experts_implementation = "grouped_mm"
    block = MixtralSparseMoeBlock(config)
    if device.type != "meta":
        for p in block.parameters():
            nn.init.normal_(p, std=0.02)
    return Layers([block]).to(dtype), (_hidden(device, dtype, grad),)


def _cross_entropy(device: torch.device, dtype: torch.dtype, grad: bool) -> Built:
    logits = torch.randn(BATCH * SEQ, VOCAB, device=device, dtype=dtype, requires_grad=grad)
    targets = torch.randint(0, VOCAB, (BATCH * SEQ,), device=device)
    return CrossEntropy(), (logits, targets)


def _cases() -> tuple[Case, ...]:
    fp32, bf16 = torch.float32, torch.bfloat16
    return (
        Case("rmsnorm", fp32, False, _rmsnorm),
        Case("rmsnorm", bf16, False, _rmsnorm),
        Case("rmsnorm", bf16, True, _rmsnorm),
        Case(
            "rmsnorm_8k_rows",
            bf16,
            True,
            _rmsnorm_wide,
            "8192 x 4096: dW joins dx as a mix-order reduction (GPU rule, >= 4096 rows)",
        ),
        Case("layernorm_gelu", fp32, False, _layernorm_gelu),
        Case("layernorm_gelu", bf16, True, _layernorm_gelu),
        Case("softmax", fp32, False, _softmax),
        Case("softmax", bf16, True, _softmax),
        Case("swiglu_layer", bf16, False, _swiglu_layer),
        Case("llama_mlp", fp32, True, _llama_mlp),
        Case("llama_layer", bf16, False, _llama()),
        Case("llama_layer", bf16, True, _llama()),
        Case("qwen3_layer", bf16, False, _qwen3),
        Case("gemma2_layer", bf16, False, _gemma2, "eager attention with soft-capping"),
        Case("gpt2_block", fp32, False, _gpt2),
        Case("gpt2_block", bf16, True, _gpt2),
        Case(
            "mixtral_moe",
            bf16,
            False,
            _mixtral_moe,
            "experts_implementation='grouped_mm' (eager loops over nonzero())",
        ),
        Case("cross_entropy", fp32, True, _cross_entropy),
        Case("cross_entropy", bf16, True, _cross_entropy, "bf16 logits upcast to fp32"),
        Case("two_llama_layers", bf16, True, _llama(2)),
        Case("float8_tensorwise_mlp", bf16, False, _float8_mlp("tensorwise"), "torchao Float8"),
        Case("float8_rowwise_mlp", bf16, False, _float8_mlp("rowwise"), "torchao Float8"),
        Case("float8_tensorwise_mlp", bf16, True, _float8_mlp("tensorwise"), "torchao Float8"),
        Case(
            "int8_weight_only_linear",
            bf16,
            False,
            _int8_weight_only,
            "gpt-fast's int8 weight-only linear at M = 1, default Inductor settings",
        ),
    )


def _key(c: Case) -> str:
    return f"{c.name}/{c.dtype_name}/{c.phases}"


CASES: dict[str, Case] = {_key(c): c for c in _cases()}
"""Every reference case by key ``name/dtype/phases`` (e.g. ``rmsnorm/bfloat16/fwd``)."""


def case(key: str) -> Case:
    """The case named ``key`` (``name/dtype/phases``)."""
    try:
        return CASES[key]
    except KeyError:
        raise KeyError(f"unknown case {key!r}; known: {', '.join(CASES)}") from None


def torchroof_fused(c: Case, **options: Any) -> list[Any]:
    """torchroof's ``fused`` kernels for the case, traced on meta (forward, and backward of
    ``out`` with a ones gradient made outside the trace); kernels that move no bytes and do
    no FLOPs are left out. ``options``: other PricingOptions fields."""
    from torchroof.api import trace
    from torchroof.config import PricingOptions
    from torchroof.kernels.fusion import build_kernels

    module, inputs = c.make("meta")
    capture = trace()
    grad_mode = torch.enable_grad() if c.backward else torch.no_grad()
    with grad_mode, capture as t:
        out = module(*inputs)
        if c.backward:
            with capture.unrecorded():
                seed = torch.ones_like(out)
            out.backward(seed)
    kernels, _ = build_kernels(t.ops, PricingOptions(fusion="fused", **options), roles=t.roles)
    return [k for k in kernels if k.cost.bytes or k.cost.flops]
