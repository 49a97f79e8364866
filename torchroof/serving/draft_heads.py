"""Draft heads that ride on the served model: EAGLE and multi-token prediction (MTP).

Instead of a separate small model, a head drafts from the served model's own last hidden
state:

- **EAGLE** (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", ICML 2024; EAGLE-3, 2025): one decoder layer of the served model's
  architecture, fed the hidden state fused with the next token's embedding by a linear
  layer, ending in the served model's LM head; vLLM's ``speculative_config`` method
  ``eagle`` / ``eagle3``.
- **MTP** (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 2.2): each MTP
  module shares the embedding and the output head, projects the hidden state and the
  embedding (2d -> d) and runs one Transformer block of the main model's kind (a
  mixture-of-experts block in DeepSeek-V3); vLLM's ``deepseek_mtp``. A configuration that
  lists ``num_nextn_predict_layers`` (transformers' ``num_mtp_layers``) has one.

A head is priced as a one-layer model of the served model's configuration: its embedding,
one decoder layer (the MTP block a routed-experts layer where the model has experts), the
final norm and the LM head, with its own one-layer KV cache, drafting as any draft model
does (:mod:`torchroof.serving.speculative`). The linear layer fusing the hidden state
with the embedding (2d x d weights; for Llama-3-8B 34 M parameters beside the head's
743 M its passes read: about 5%) is not priced.
"""

from __future__ import annotations

import copy
from typing import Any

from torchroof.config.errors import OptionError

HEADS = {"eagle": "an EAGLE head", "mtp": "a multi-token prediction head"}
"""The heads ``--draft`` takes by name, and how they are called."""

EXPERT_COUNTS = ("num_local_experts", "n_routed_experts", "num_experts")
"""Configuration fields that count routed experts (transformers' names across models)."""

MTP_COUNTS = ("num_nextn_predict_layers", "num_mtp_layers")
"""Configuration fields that count a model's multi-token prediction modules."""


def is_head(draft: Any) -> bool:
    """Whether a draft names a head on the served model rather than a draft model."""
    return isinstance(draft, str) and draft in HEADS


def head_label(kind: str, served: str) -> str:
    """What a result records as the draft: ``"EAGLE head of llama-3-8b"``."""
    return f"{kind.upper()} head of {served}"


def _routed_experts(config: Any) -> bool:
    return any(isinstance(n := getattr(config, key, None), int) and n > 1 for key in EXPERT_COUNTS)


def head_config(kind: str, config: Any, served: str) -> Any:
    """The one-layer model a ``kind`` head of the served model (its ``config``) drafts
    with; a model that has no such head is refused in one line."""
    if config is None:
        raise OptionError(
            f"{HEADS[kind]} is made from the served model's configuration: {served} has none "
            "(give a draft model instead)"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = copy.deepcopy(text)
    layers = head.num_hidden_layers
    if kind == "mtp":
        if not any(getattr(text, key, None) for key in MTP_COUNTS):
            raise OptionError(
                f"{served} has no multi-token prediction layers (its configuration lists no "
                "num_nextn_predict_layers): draft with eagle or a draft model"
            )
        if hasattr(head, "first_k_dense_replace"):  # the MTP block is one of the later kind
            head.first_k_dense_replace = 0
    elif _routed_experts(text):
        raise OptionError(
            f"{served} routes tokens to experts: an EAGLE head of it is not priced yet (give "
            "the head's own configuration as the draft model)"
        )
    head.num_hidden_layers = 1
    kinds = getattr(head, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) == layers:  # the head is the last layer's kind
        head.layer_types = kinds[-1:]
    return head
