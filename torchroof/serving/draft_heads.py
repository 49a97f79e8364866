"""Draft heads that ride on the served model: EAGLE and multi-token prediction (MTP).

Instead of a separate small model, a head drafts from the served model's own last hidden
state:

- **EAGLE** (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", ICML 2024, and EAGLE-2): one decoder layer of the served model's
  architecture, fed the hidden state fused with the next token's embedding by a linear
  layer, ending in the served model's LM head; vLLM's ``speculative_config`` method
  ``eagle``. (EAGLE-3 heads fuse three hidden states and keep their own smaller
  vocabulary: give such a head's configuration as a draft model.)
- **MTP** (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 2.2): each MTP
  module shares the embedding and the output head, projects the hidden state and the
  embedding (2d -> d) and runs one Transformer block of the main model's kind (a
  mixture-of-experts block in DeepSeek-V3 and GLM-4.5); vLLM's ``deepseek_mtp``. A
  configuration that lists ``num_nextn_predict_layers`` (or ``num_mtp_layers``,
  ``mtp_num_hidden_layers``) has one.

A head is timed as a one-layer model of the served model's configuration: its embedding,
one decoder layer of the model's last kind (every per-layer list of the configuration cut
to its last entry, every "dense below layer N" setting cleared), the final norm and the
LM head, with its own one-layer KV cache, drafting as a draft model does
(:mod:`torchroof.serving.speculative`) but for its first pass of a step, which runs over
every token a decoding request verified (k + 1, rejected ones included: vLLM's padded
drafter batch) on the served model's hidden states. Its memory holds the layer alone: the
embedding and the LM head are the served model's (vLLM's ``EagleProposer`` shares them),
their bytes measured as a two-layer copy's less twice the one-layer copy's. Not priced:
the linear layer fusing the hidden state with the embedding (2d x d weights; for
Llama-3-8B 34 M parameters beside the 743 M a pass reads, about 5%).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from torchroof.config.errors import OptionError
from torchroof.models.sources import text_config
from torchroof.prepared import prepare
from torchroof.pricing.routing import top_k_by_experts
from torchroof.progress import silenced
from torchroof.records.trace import Trace

if TYPE_CHECKING:
    from torchroof.serving.step_time import StepTimer

HEADS = {"eagle": "an EAGLE head", "mtp": "a multi-token prediction head"}
"""The heads ``--draft`` takes by name, and how they are called."""

MTP_COUNTS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
"""Configuration fields that count a model's multi-token prediction modules."""

LAYER_PLACEMENT = {"first_k_dense_replace": 0, "moe_layer_start_index": 0, "mlp_only_layers": []}
"""Fields that place dense layers below an index (DeepSeek, GLM, ERNIE, Qwen-MoE), set so
the head's one layer is of the model's later kind."""


def is_head(draft: Any) -> bool:
    """Whether a draft names a head on the served model rather than a draft model."""
    return isinstance(draft, str) and draft in HEADS


def head_label(kind: str, served: str, config: Any) -> str:
    """What a result records as the draft: ``"EAGLE head of llama-3-8b"`` (the model's type
    where the served model is a configuration object)."""
    if served.endswith("Config") and config is not None:
        served = str(getattr(config, "name_or_path", "") or config.model_type)
    return f"{kind.upper()} head of {served}"


def _text(config: Any) -> Any:
    """``config``'s text model's configuration; None for a composite of several."""
    try:
        return text_config(config)
    except ValueError:  # transformers: several text models, none the one
        return None


def _has_mtp(config: Any) -> bool:
    return any(getattr(c, key, None) for c in (config, _text(config)) for key in MTP_COUNTS)


def head_config(kind: str, config: Any, served: str, layers: int = 1) -> Any:
    """The model a ``kind`` head of the served model (its ``config``) drafts with:
    ``layers`` (1; 2 to measure the shared weights) layers of the model's last kind; a
    model that has no such head is refused in one line."""
    if config is None:
        raise OptionError(
            f"{HEADS[kind]} is made from the served model's configuration: {served} has none "
            "(give a draft model instead)"
        )
    if kind == "mtp" and not _has_mtp(config):
        raise OptionError(
            f"{served} has no multi-token prediction layers (its configuration lists none of "
            f"{', '.join(MTP_COUNTS)}): draft with eagle or a draft model"
        )
    text = _text(config)
    if text is None:
        raise OptionError(f"{served}: its configuration holds several text models, none the one")
    head = copy.deepcopy(text)
    count = head.num_hidden_layers
    for name, value in list(vars(head).items()):
        if isinstance(value, list) and len(value) == count:
            setattr(head, name, value[-1:] * layers)  # the model's last layer's kind
    for name, value in LAYER_PLACEMENT.items():
        if hasattr(head, name):
            setattr(head, name, copy.copy(value))
    head.num_hidden_layers = layers
    return head


def routes_experts(timer: StepTimer) -> bool:
    """Whether a step timer's prepared decode routes tokens to experts."""
    trace = timer.prepared.trace()
    return isinstance(trace, Trace) and bool(top_k_by_experts(trace))


def check_head(kind: str, experts: bool, head: StepTimer | None, label: str) -> None:
    """Refuse an EAGLE head of a model with routed experts (``experts``: the served model's
    decode routes them; before ``head`` is made: None), and an MTP block that came out
    without the experts its model routes to."""
    if kind == "eagle" and experts:
        raise OptionError(
            f"{label}: the served model routes tokens to experts, and an EAGLE head of it is "
            "not priced yet (give the head's own configuration as the draft model)"
        )
    if kind == "mtp" and head is not None and experts and not routes_experts(head):
        raise OptionError(
            f"{label}: its one block came out without the routed experts of the served model "
            "(a layer layout torchroof does not read): give the block's configuration as the "
            "draft model"
        )


def shared_weights_bytes(
    kind: str, target: StepTimer, head: StepTimer, served: str, **workload: Any
) -> int:
    """Per GPU, the bytes of the head that are the served model's (its embedding, LM head
    and final norm): a one-layer copy's weights less what a second layer adds."""
    two = prepare(
        head_config(kind, target.config, served, layers=2),
        "decode",
        context=head.context,
        **workload,
    )
    with silenced():
        one_s = head.prepared.price(target.hardware, pricing=target.pricing, batch=1).memory
        two_s = two.price(target.hardware, pricing=target.pricing, batch=1).memory
    if one_s is None or two_s is None:
        return 0
    shared = 2 * one_s.weights_bytes - two_s.weights_bytes
    if not 0 <= shared <= one_s.weights_bytes:  # the two copies' layers differ
        raise OptionError(
            f"{HEADS[kind]} of {served}: a second layer of its kind is not the first (a layer "
            "layout torchroof does not read): give the head's configuration as the draft model"
        )
    return shared
