"""``torchroof.serve``: a model served to a stream of requests on a deployment, simulated.

It prepares the model for decode once (:func:`torchroof.prepare`, at a short context: the
simulation sizes every step from its requests), draws or reads the requests, and runs
:func:`~torchroof.serving.simulate.simulate`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from torchroof.config import PricingOptions, split_knobs
from torchroof.config.errors import OptionError
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.prepared import prepare
from torchroof.progress import reporting
from torchroof.serving.disaggregated import (
    DISAGGREGATED_GROUPS,
    check_disaggregated,
    simulate_disaggregated,
)
from torchroof.serving.disaggregation import Layout, Side, sides
from torchroof.serving.draft_heads import (
    check_head,
    head_config,
    head_label,
    is_head,
    routes_experts,
    shared_weights_bytes,
)
from torchroof.serving.load_curve import LoadCurve, check_load, load_curve
from torchroof.serving.rate_search import RateSearch, check_targets, search_rate
from torchroof.serving.requests import (
    Arrivals,
    Lengths,
    Prefixes,
    Request,
    make_requests,
    read_requests,
)
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.simulate import check_group, simulate
from torchroof.serving.speculative import Acceptance, Drafter, Speculative, check_draft
from torchroof.serving.step_time import StepTimer, coupled_ranks

PREPARED_CONTEXT = 128
"""The context the decode is prepared at: only transformers' dense mask reads it (one byte
per key and layer), every step's attention is priced over its own requests' caches."""

Drawn = tuple[str | int, str | int, "Prefixes | None"]
"""Drawn requests' input lengths, output lengths and shared prefixes."""

SIZED_BY_REQUESTS = ("regime", "batch", "seq", "context", "microbatches")


def serve(
    model: Any = DEFAULT_MODEL,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    requests: int | str | Path | Sequence[Request] = 1000,
    input_len: str | int = 1024,
    output_len: str | int = 128,
    prefixes: Prefixes | None = None,
    burstiness: float = 1.0,
    random_state: int = 0,
    engine: EngineConfig | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    speculative: Speculative | None = None,
    exact_up_to: int | None = None,
    pricing: PricingOptions | None = None,
    progress: bool = False,
    disaggregate: str | None = None,
    prefill: Mapping[str, Any] | None = None,
    decode: Mapping[str, Any] | None = None,
    **knobs: Any,
) -> ServeResult:
    """Simulate serving ``requests`` (a count to draw, a JSONL/CSV file, or
    :class:`Request` objects) with ``model`` on ``replicas`` engines of ``hardware``
    (with ``ep`` above ``tp``, the data-parallel ranks: each group of ep / tp steps in
    lock-step, and ``replicas`` is a multiple of it).

    Requests arrive at ``rate`` per second (Poisson; ``burstiness`` below 1 draws gamma
    gaps of shape ``burstiness``, as vLLM's serving benchmark does), or are sent by
    ``concurrency`` closed-loop clients, or arrive at a file's own ``arrival_s``. Drawn
    lengths follow ``input_len`` and ``output_len`` (``512``, ``uniform:128,2048``, ...:
    :class:`~torchroof.serving.requests.Lengths`), drawn from ``random_state``; with
    ``prefixes`` (:class:`~torchroof.serving.requests.Prefixes`) each drawn prompt starts
    with one of its groups' shared prefixes. ``knobs`` are the
    deployment's workload fields (``tp``, ``ep``, ``dtype``, ``kv_dtype``, ``quant``) and
    pricing options (``mode``, ``runtime``, ...); ``engine`` the scheduler's knobs;
    ``speculative`` a draft model decoding speculatively
    (:class:`~torchroof.serving.speculative.Speculative`), its acceptances drawn from
    ``random_state`` too.

    ``disaggregate="xPyD"`` serves on x prefill and y decode instances of a cluster instead
    of replicas (:mod:`torchroof.serving.disaggregated`); ``prefill`` and ``decode`` give
    each side's own workload and engine knobs (``{"tp": 4}``, ``{"max_num_seqs": 128}``).
    """
    batch = load_requests(
        requests, rate, concurrency, (input_len, output_len, prefixes), burstiness, random_state
    )
    _check_speculative(speculative)  # before anything is traced
    if disaggregate is not None or prefill is not None or decode is not None:
        if speculative is not None:
            raise OptionError(
                "speculative decoding on disaggregated prefill and decode is not simulated "
                "yet: serve one or the other"
            )
        split = _sides(disaggregate, prefill, decode, engine, replicas, knobs)
        if any(coupled_ranks(*_sizes(side.knobs)) > 1 for side in split):
            raise OptionError(DISAGGREGATED_GROUPS)
        check_disaggregated(batch, (split[0].engine, split[1].engine), hardware)  # untraced
        timers = tuple(
            deployment_timer(model, hardware, side.knobs, pricing, exact_up_to, progress)
            for side in split
        )
        with reporting(progress):
            return simulate_disaggregated(
                (timers[0], timers[1]),
                batch,
                layout=str(disaggregate),
                engines=(split[0].engine, split[1].engine),
                concurrency=concurrency,
                router=router,
            )
    check_group(*_sizes(knobs), replicas)  # before anything is traced
    timer = deployment_timer(model, hardware, knobs, pricing, exact_up_to, progress)
    drafter = _drafter(speculative, timer, knobs, progress)
    with reporting(progress):
        return simulate(
            timer,
            batch,
            engine=engine,
            concurrency=concurrency,
            replicas=replicas,
            router=router,
            drafter=drafter,
            random_state=random_state,
        )


def highest_rate(
    model: Any = DEFAULT_MODEL,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    *,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    attainment: float = 0.9,
    requests: int | str | Path | Sequence[Request] = 500,
    input_len: str | int = 1024,
    output_len: str | int = 128,
    prefixes: Prefixes | None = None,
    burstiness: float = 1.0,
    random_state: int = 0,
    engine: EngineConfig | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    speculative: Speculative | None = None,
    exact_up_to: int | None = None,
    pricing: PricingOptions | None = None,
    progress: bool = False,
    **knobs: Any,
) -> RateSearch:
    """The highest request rate at which ``attainment`` of ``requests`` meet the TTFT and
    TPOT targets (:func:`~torchroof.serving.rate_search.search_rate`), the other arguments
    as :func:`serve` takes them. Drawn requests arrive at 1 per second; a file's own
    arrival times are kept, scaled to a mean of 1 per second; each rate tried scales
    them again."""
    check_targets(ttft_s, tpot_s, attainment)  # before anything is traced
    _refuse_sides(knobs, "a rate search")
    _check_speculative(speculative)
    batch = _unit_rate(requests, (input_len, output_len, prefixes), burstiness, random_state)
    check_group(*_sizes(knobs), replicas)
    timer = deployment_timer(model, hardware, knobs, pricing, exact_up_to, progress)
    drafter = _drafter(speculative, timer, knobs, progress)
    with reporting(progress):
        return search_rate(
            timer,
            batch,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            attainment=attainment,
            engine=engine,
            replicas=replicas,
            router=router,
            drafter=drafter,
            random_state=random_state,
        )


def _sizes(knobs: Mapping[str, Any]) -> tuple[int, int]:
    """(tp, ep) of the workload keywords, (1, 1) where any of tp, ep and dp is not a whole
    number or ep does not divide dp x tp in multiples of tp (the workload refuses those in
    its own line)."""
    sizes = [knobs.get(name, 1) for name in ("tp", "ep", "dp")]
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        return 1, 1
    tp, ep, dp = sizes
    return (tp, ep) if ep % tp == 0 and (dp * tp) % ep == 0 else (1, 1)


def _refuse_sides(knobs: dict[str, Any], what: str) -> None:
    """Disaggregated serving's keywords given where they are not taken, refused in a line."""
    given = sorted({"disaggregate", "prefill", "decode"} & set(knobs))
    if given:
        raise OptionError(
            f"{what} does not take a disaggregated deployment yet ({', '.join(given)} "
            "given): serve it at one rate with torchroof.serve(disaggregate=...)"
        )


def _sides(
    disaggregate: str | None,
    prefill: Mapping[str, Any] | None,
    decode: Mapping[str, Any] | None,
    engine: EngineConfig | None,
    replicas: int,
    knobs: dict[str, Any],
) -> tuple[Side, Side]:
    """Each side's knobs for ``disaggregate`` (checked before anything is traced)."""
    if disaggregate is None:
        raise OptionError(
            "prefill and decode knobs are for disaggregated serving: give disaggregate='xPyD'"
        )
    Layout.parse(disaggregate)
    if replicas != 1:
        raise OptionError(
            f"disaggregate={disaggregate!r} sets the instances: replicas={replicas!r} is not taken"
        )
    return sides(knobs, engine or EngineConfig(), prefill, decode)


def serve_rates(
    model: Any = DEFAULT_MODEL,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    *,
    rates: Sequence[float],
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    requests: int | str | Path | Sequence[Request] = 500,
    input_len: str | int = 1024,
    output_len: str | int = 128,
    prefixes: Prefixes | None = None,
    burstiness: float = 1.0,
    random_state: int = 0,
    engine: EngineConfig | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    speculative: Speculative | None = None,
    exact_up_to: int | None = None,
    pricing: PricingOptions | None = None,
    progress: bool = False,
    **knobs: Any,
) -> LoadCurve:
    """The same requests served one at a time, then at each of ``rates`` per second
    (:func:`~torchroof.serving.load_curve.load_curve`): latency and throughput against the
    offered rate, and its knee. The requests arrive as :func:`highest_rate` sends them,
    the other arguments as :func:`serve` takes them."""
    check_load(rates, ttft_s, tpot_s)  # before anything is traced
    _refuse_sides(knobs, "serving a list of rates")
    _check_speculative(speculative)
    batch = _unit_rate(requests, (input_len, output_len, prefixes), burstiness, random_state)
    check_group(*_sizes(knobs), replicas)
    timer = deployment_timer(model, hardware, knobs, pricing, exact_up_to, progress)
    drafter = _drafter(speculative, timer, knobs, progress)
    with reporting(progress):
        return load_curve(
            timer,
            batch,
            rates,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            engine=engine,
            replicas=replicas,
            router=router,
            drafter=drafter,
            random_state=random_state,
        )


def _unit_rate(
    requests: int | str | Path | Sequence[Request],
    drawn: Drawn,
    burstiness: float,
    random_state: int,
) -> list[Request]:
    """The requests arriving at a mean of 1 per second: drawn so, or given with their own
    times (a file's), shifted to start at 0 and scaled; given without times, drawn so."""
    if isinstance(requests, int) and not isinstance(requests, bool):
        return load_requests(requests, 1.0, None, drawn, burstiness, random_state)
    _check_burstiness(burstiness)
    given = _given(requests, drawn[2])
    times = [r.arrival_s for r in given]
    if any(t is None for t in times) or len(given) < 2:
        return _retimed(given, 1.0, burstiness, random_state)
    first, last = min(t or 0.0 for t in times), max(t or 0.0 for t in times)
    if last == first:
        raise OptionError(
            "the requests all arrive at one time: a rate search needs their arrivals spread"
        )
    gap = (last - first) / (len(given) - 1)
    return [replace(r, arrival_s=((r.arrival_s or 0.0) - first) / gap) for r in given]


def deployment_timer(
    model: Any,
    hardware: str | Path | HardwareSpec | ClusterSpec,
    knobs: dict[str, Any],
    pricing: PricingOptions | None,
    exact_up_to: int | None,
    progress: bool,
) -> StepTimer:
    """The deployment's step timer: the model prepared for decode with the workload
    keywords of ``knobs``, priced with its pricing keywords."""
    workload, pricing_knobs = split_knobs(knobs)
    sized = sorted(set(workload) & set(SIZED_BY_REQUESTS))
    if sized:
        raise OptionError(
            f"serve sizes each step from its requests: {', '.join(sized)} is not taken"
        )
    prepared = prepare(model, "decode", progress=progress, context=PREPARED_CONTEXT, **workload)
    return StepTimer(prepared, hardware, pricing=pricing, exact_up_to=exact_up_to, **pricing_knobs)


def _drafter(
    speculative: Speculative | None, target: StepTimer, knobs: dict[str, Any], progress: bool
) -> Drafter | None:
    """The draft model's step timer, prepared as the target is (its dtype, KV dtype and
    quantisation, at the target's tensor-parallel size unless ``speculative.tp`` says),
    priced on the target's hardware with the target's pricing; a head (``"eagle"``,
    ``"mtp"``: :mod:`torchroof.serving.draft_heads`) as a one-layer model of the target's
    configuration."""
    if speculative is None:
        return None
    acceptance = _check_speculative(speculative)
    assert acceptance is not None
    workload, _ = split_knobs(knobs)
    target_tp = target.describe()["tp"]
    if speculative.tp is not None and speculative.tp not in (1, target_tp):
        raise OptionError(
            f"the draft's tp is 1 or the served model's ({target_tp}), got {speculative.tp}: "
            "the draft runs on the engine's own GPUs (vLLM refuses other sizes likewise)"
        )
    if speculative.tp is not None:
        workload["tp"] = speculative.tp
    kind = speculative.draft if is_head(speculative.draft) else ""
    served = target.describe()["model"]
    label = head_label(kind, served, target.config) if kind else ""
    if kind and speculative.tp not in (None, target_tp):
        raise OptionError(
            f"{label} shares the served model's embedding and LM head: it runs at the model's "
            f"tensor-parallel size ({target_tp}), not {speculative.tp}"
        )
    experts = routes_experts(target) if kind else False
    if kind:
        check_head(kind, experts, None, label)
    if kind != "mtp":
        workload.pop("ep", None)  # a draft model is dense; an MTP block is the model's kind
    draft = head_config(kind, target.config, served) if kind else speculative.draft
    prepared = prepare(draft, "decode", progress=progress, context=PREPARED_CONTEXT, **workload)
    timer = StepTimer(
        prepared, target.hardware, pricing=target.pricing, exact_up_to=target.exact_up_to
    )
    check_draft(target, timer)
    shared = 0
    if kind:
        check_head(kind, experts, timer, label)
        shared = shared_weights_bytes(kind, target, timer, served, **workload)
    return Drafter(timer, acceptance, label, shared)


def _check_speculative(speculative: object) -> Acceptance | None:
    """The acceptance rates of ``speculative``, refused in a line where they are bad."""
    if speculative is None:
        return None
    if not isinstance(speculative, Speculative):
        raise OptionError(
            f"speculative must be a torchroof.serving.Speculative, got {speculative!r}"
        )
    return speculative.rates()


def load_requests(
    requests: int | str | Path | Sequence[Request],
    rate: float | None,
    concurrency: int | None,
    drawn: Drawn,
    burstiness: float,
    random_state: int,
) -> list[Request]:
    """The requests to serve, with their arrival times where the load is open; ``drawn``
    the lengths and prefixes of requests drawn by count."""
    if rate is not None and concurrency is not None:
        raise OptionError("give a request rate or a concurrency, not both")
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
    ):
        raise OptionError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
    _check_burstiness(burstiness)
    input_len, output_len, prefixes = drawn
    if isinstance(requests, int) and not isinstance(requests, bool):
        inputs, outputs = (
            Lengths.parse(input_len, "input_len"),
            Lengths.parse(output_len, "output_len"),
        )
        if prefixes is not None and not isinstance(prefixes, Prefixes):
            raise OptionError(
                f"prefixes must be a torchroof.serving.requests.Prefixes, got {prefixes!r}"
            )
        if rate is None and concurrency is None:
            raise OptionError("give a request rate (per second) or a concurrency")
        arrivals = (
            Arrivals("closed", concurrency=concurrency)
            if concurrency is not None
            else _open(rate, burstiness)
        )
        return make_requests(requests, inputs, outputs, arrivals, random_state, prefixes)
    given = _given(requests, prefixes)
    if rate is not None:  # new arrival times at the rate, the lengths as given
        return _retimed(given, rate, burstiness, random_state)
    if concurrency is None and any(r.arrival_s is None for r in given):
        raise OptionError(
            "the requests give no arrival times: give a request rate or a concurrency"
        )
    return given


def _check_burstiness(burstiness: float) -> None:
    if not (isinstance(burstiness, (int, float)) and burstiness > 0 and math.isfinite(burstiness)):
        raise OptionError(f"burstiness must be above 0 (1 is Poisson), got {burstiness}")


def _given(requests: object, prefixes: Prefixes | None = None) -> list[Request]:
    """The requests of a JSONL/CSV file or a sequence of :class:`Request` objects."""
    if prefixes is not None:
        raise OptionError(
            "prefixes are drawn with the requests: given requests carry their own "
            "prefix_group and prefix_len"
        )
    if isinstance(requests, (str, Path)):
        return read_requests(requests)
    if isinstance(requests, Sequence):
        given = list(cast(Sequence[Request], requests))
        if not all(isinstance(r, Request) for r in given):
            raise OptionError("requests must be a count, a file, or Request objects")
        return given
    raise OptionError(f"requests must be a count, a file, or Request objects, got {requests!r}")


def _retimed(
    given: list[Request], rate: float, burstiness: float, random_state: int
) -> list[Request]:
    """``given``'s lengths with new arrival times drawn at ``rate``."""
    times = _open(rate, burstiness).times(_rng(random_state), len(given))
    return [replace(r, arrival_s=t) for r, t in zip(given, times, strict=True)]


def _open(rate: float | None, burstiness: float) -> Arrivals:
    assert rate is not None
    if burstiness == 1:
        return Arrivals("poisson", rate=rate)
    return Arrivals("gamma", rate=rate, cv=1 / math.sqrt(burstiness))


def _rng(random_state: int) -> Any:
    import numpy as np

    return np.random.default_rng(random_state)
