"""Every serving layout of a model on up to N GPUs that torchroof simulates, and why each
family it leaves out is left out.

An engine spans ``tp`` GPUs of one node: tensor parallel splits whole query and K/V heads
(transformers' ``base_model_tp_plan``, :func:`~torchroof.parallel.tensor.
check_tensor_parallel`), and its all-reduces stay on the node's NVLink (vLLM's and SGLang's
``--tensor-parallel-size`` / ``--tp-size`` within a node, their docs' "Distributed
inference and serving"). ``replicas`` such engines sit behind a router, tp x replicas <=
``gpus_max``. A MoE model's routed experts are split over the engine's own GPUs (ep = tp,
SGLang's ``--ep-size``; vLLM's ``--enable-expert-parallel`` spans tp x its data-parallel
ranks, so for vLLM that is one engine), so ep must divide the experts. A MoE model is also
served with data-parallel attention: ``dp`` engines of tp GPUs, each with its own
scheduler and requests, its attention and dense layers whole, stepping in lock-step
(:mod:`torchroof.serving.simulate`), and the routed experts
spread over all dp x tp GPUs of the group (ep = dp x tp; vLLM's ``--data-parallel-size``
with ``--enable-expert-parallel``, SGLang's ``--enable-dp-attention``; docs.vllm.ai, "Data
Parallel Deployment"): the deployment DeepSeek-V3's latent attention, which tensor
parallel does not split here, is served with. By default, with each tp, the largest group
within a node and ``gpus_max`` whose dp x tp divides the experts. Each
engine's scheduler knobs (``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill) and
its KV cache dtype are searched from short lists; a disaggregated ``xPyD`` deployment (x
prefill and y decode instances, DistServe, Zhong et al. 2024) only where asked, each
side's tp from the same sizes, x x prefill tp + y x decode tp <= ``gpus_max``.

NB: pipeline parallel (pp = 1), expert parallel other than ep = tp or dp x tp, several
data-parallel groups behind one router, speculative decoding, routers other than
round-robin and engines or data-parallel groups of more than one node are not searched yet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from itertools import product
from typing import Any

from torchroof.config.choices import KV_DTYPES
from torchroof.config.errors import OptionError
from torchroof.parallel.tensor import check_tensor_parallel
from torchroof.planning.layouts import ServingLayout
from torchroof.planning.space import model_facts
from torchroof.serving.disaggregation import Layout

DEFAULT_MAX_NUM_SEQS = (64, 128, 256)
"""Running requests per engine searched: vLLM's default (256) and two narrower batches,
which bound each decode step (and so TPOT) at the cost of queueing."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = (2048, 8192)
"""New tokens per step searched: vLLM's default (8192) and the 2048 its docs suggest for a
lower TPOT under chunked prefill ("Optimization and Tuning", docs.vllm.ai)."""


@dataclass(frozen=True)
class ServingSpace:
    """What a serving search may choose. ``tp`` None: every divisor of a node's GPUs;
    ``replicas`` None: 1 to gpus_max // tp; ``dp`` None: for a MoE model, with each tp the
    largest data-parallel attention group within a node and gpus_max whose GPUs split the
    experts (1 adds nothing); ``kv_dtype`` among
    ``model``, ``fp8``, ``int8``; ``disaggregate`` the xPyD deployments to try beside
    replicas (none unless given)."""

    gpus_max: int
    gpus_per_node: int
    tp: tuple[int, ...] | None = None
    replicas: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    max_num_seqs: tuple[int, ...] = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: tuple[int, ...] = DEFAULT_MAX_NUM_BATCHED_TOKENS
    chunked_prefill: tuple[bool, ...] = (True,)
    kv_dtype: tuple[str, ...] = ("model",)
    disaggregate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("gpus_max", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("tp", "replicas", "dp", "max_num_seqs", "max_num_batched_tokens"):
            sizes = getattr(self, name)
            if sizes is not None and (
                not isinstance(sizes, tuple)
                or not sizes
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            ):
                raise OptionError(f"{name} must list whole numbers >= 1, got {sizes!r}")
        bad = [kv for kv in self.kv_dtype if kv not in KV_DTYPES]
        if bad or not self.kv_dtype:
            raise OptionError(
                f"kv_dtype must list some of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        if not self.chunked_prefill or any(not isinstance(c, bool) for c in self.chunked_prefill):
            raise OptionError(
                f"chunked_prefill must list True and/or False, got {self.chunked_prefill!r}"
            )
        for text in self.disaggregate:
            Layout.parse(text)  # a bad xPyD refused in its own line


def serving_space(gpus_max: int, gpus_per_node: int, given: dict[str, Any] | None) -> ServingSpace:
    """The space of ``given`` (fields of :class:`ServingSpace` but the GPU counts), lists
    given as tuples; an unknown field refused in one line."""
    given = dict(given or {})
    names = {f.name for f in fields(ServingSpace)} - {"gpus_max", "gpus_per_node"}
    unknown = sorted(set(given) - names)
    if unknown:
        raise OptionError(
            f"the serving space has no {unknown[0]!r}; it takes {', '.join(sorted(names))}"
        )
    for name, value in given.items():
        if isinstance(value, (list, set)):
            value = sorted(value) if isinstance(value, set) else value
        elif isinstance(value, (int, str)) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (tuple, list)):
            raise OptionError(f"{name} takes a list of choices, got {value!r}")
        given[name] = tuple(dict.fromkeys(value))  # each choice once, in the order given
    return ServingSpace(gpus_max=gpus_max, gpus_per_node=gpus_per_node, **given)


@dataclass
class ServingEnumeration:
    """The layouts to simulate, and each left-out family's reason with how many times it
    held (a family: every layout under one refused choice, counted once)."""

    layouts: list[ServingLayout] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)


def enumerate_serving(config: Any, space: ServingSpace) -> ServingEnumeration:
    """Every layout of ``space`` that ``config``'s model can be served with, and the
    reasons for the rest (:class:`ServingEnumeration`)."""
    out = ServingEnumeration()
    experts = model_facts(config).experts
    sizes = _engine_sizes(config, space, experts, out)
    engines = list(product(space.max_num_seqs, space.max_num_batched_tokens, space.chunked_prefill))
    kvs = [None if kv == "model" else kv for kv in dict.fromkeys(space.kv_dtype)]
    for tp in sizes:
        for replicas in space.replicas or range(1, space.gpus_max // tp + 1):
            if tp * replicas > space.gpus_max:
                out.rejected[
                    f"tp={tp} x {replicas} replicas needs {tp * replicas} GPUs, above "
                    f"gpus_max={space.gpus_max}"
                ] += 1
                continue
            for kv, (seqs, tokens, chunked) in product(kvs, engines):
                out.layouts.append(
                    ServingLayout(
                        tp=tp, ep=tp if experts else 1, replicas=replicas, max_num_seqs=seqs,
                        max_num_batched_tokens=tokens, chunked_prefill=chunked, kv_dtype=kv,
                    )
                )  # fmt: skip
    for tp, dp in _attention_groups(sizes, space, experts, out):
        for kv, (seqs, tokens, chunked) in product(kvs, engines):
            out.layouts.append(
                ServingLayout(
                    tp=tp, ep=tp * dp, replicas=dp, max_num_seqs=seqs,
                    max_num_batched_tokens=tokens, chunked_prefill=chunked, kv_dtype=kv,
                )
            )  # fmt: skip
    for text in dict.fromkeys(space.disaggregate):
        split = Layout.parse(text)
        for prefill_tp, decode_tp in product(sizes, sizes):
            gpus = split.prefill * prefill_tp + split.decode * decode_tp
            if gpus > space.gpus_max:
                out.rejected[
                    f"{split} with prefill tp={prefill_tp} and decode tp={decode_tp} needs "
                    f"{gpus} GPUs, above gpus_max={space.gpus_max}"
                ] += 1
                continue
            if experts and prefill_tp != decode_tp:
                out.rejected[
                    f"{split} with prefill tp={prefill_tp} and decode tp={decode_tp}: a MoE "
                    "model's sides share one expert-parallel size (ep = tp), so their tp match"
                ] += 1
                continue
            for kv, (seqs, tokens, chunked) in product(kvs, engines):
                out.layouts.append(
                    ServingLayout(
                        ep=prefill_tp if experts else 1, max_num_seqs=seqs,
                        max_num_batched_tokens=tokens, chunked_prefill=chunked, kv_dtype=kv,
                        disaggregate=str(split), prefill_tp=prefill_tp, decode_tp=decode_tp,
                    )
                )  # fmt: skip
    return out


def _engine_sizes(
    config: Any, space: ServingSpace, experts: int, out: ServingEnumeration
) -> list[int]:
    """The tp sizes an engine may take: divisors of a node's GPUs (or those given that
    divide it) within ``gpus_max``, whose heads (and, for a MoE, experts) split by tp."""
    node = space.gpus_per_node
    divisors = [d for d in range(1, node + 1) if node % d == 0]
    kept = []
    for tp in sorted(set(space.tp)) if space.tp is not None else divisors:
        if node % tp:
            out.rejected[f"tp={tp} does not divide the {node} GPUs of a node"] += 1
            continue
        if tp > space.gpus_max:
            out.rejected[f"tp={tp} exceeds gpus_max={space.gpus_max}"] += 1
            continue
        try:
            check_tensor_parallel(config, tp)
        except ValueError as error:
            out.rejected[f"tp={tp}: {str(error).splitlines()[0]}"] += 1
            continue
        if experts and experts % tp:
            out.rejected[f"ep={tp} (= tp) does not divide the {experts} routed experts"] += 1
            continue
        kept.append(tp)
    return kept


def _attention_groups(
    sizes: list[int], space: ServingSpace, experts: int, out: ServingEnumeration
) -> list[tuple[int, int]]:
    """The (tp, dp) of each data-parallel attention group to serve on: dp engines of tp
    GPUs within one node and ``gpus_max``, whose dp x tp divides the routed experts; by
    default the largest such dp above 1 for each tp."""
    node = space.gpus_per_node
    room = min(node, space.gpus_max)
    if not experts:
        if space.dp is not None and any(dp > 1 for dp in space.dp):
            out.rejected[
                "data-parallel attention spreads a MoE model's experts: a dense model's "
                "engines are replicas"
            ] += 1
        return []
    groups = []
    for tp in sizes:
        if space.dp is None:  # the largest group that fits and splits the experts
            dp = next((d for d in range(room // tp, 1, -1) if experts % (tp * d) == 0), 1)
            groups += [(tp, dp)] if dp > 1 else []
            continue
        for dp in space.dp:
            if dp < 2:
                continue
            where, gpus = f"tp={tp} x dp={dp} (data-parallel attention)", tp * dp
            if gpus > node:
                out.rejected[f"{where} spans {gpus} GPUs, past one node's {node}"] += 1
            elif gpus > space.gpus_max:
                out.rejected[f"{where} needs {gpus} GPUs, above gpus_max={space.gpus_max}"] += 1
            elif experts % gpus:
                out.rejected[f"{where}: ep={gpus} does not divide the {experts} experts"] += 1
            else:
                groups.append((tp, dp))
    return groups


def layout_label(layout: ServingLayout) -> str:
    """The layout in a line: ``tp 2 x 2 replicas, 128 seqs, 8,192 tokens/step, kv fp8``
    (``1P2D: prefill tp 2, decode tp 1, ...`` disaggregated)."""
    if layout.attention_dp > 1:
        parts = [f"tp {layout.tp} x dp {layout.attention_dp} (data-parallel attention)"]
    elif layout.disaggregate is None:
        replicas = f"{layout.replicas} replica" + ("s" if layout.replicas > 1 else "")
        parts = [f"tp {layout.tp} x {replicas}"]
    else:
        parts = [
            f"{layout.disaggregate}: prefill tp {layout.prefill_tp}, decode tp {layout.decode_tp}"
        ]
    if layout.ep > 1:
        parts.append(f"ep {layout.ep}")
    parts.append(f"{layout.max_num_seqs} seqs")
    parts.append(f"{layout.max_num_batched_tokens:,} tokens/step")
    if not layout.chunked_prefill:
        parts.append("no chunked prefill")
    if layout.kv_dtype is not None:
        parts.append(f"kv {layout.kv_dtype}")
    if layout.quant != "none":
        parts.append(f"quant {layout.quant}")
    return ", ".join(parts)
