"""The serving plan search: every serving layout of a model on up to N GPUs
(:mod:`.serving_space`), each simulated at one load as :func:`torchroof.serve` simulates it,
and the fewest GPUs that meet the latency targets.

Every layout serves the same requests (one draw, one random state), so their figures
compare like for like. A layout meets the targets when at least ``attainment`` of its
requests see a TTFT and a TPOT within them (DistServe's SLO attainment, Zhong et al. 2024,
as :func:`torchroof.serving.highest_rate` reads it). Layouts are simulated on step timers
shared between every layout of one engine shape: building a timer traces the model, and a
timer prices any step of any batch, so replicas and scheduler knobs reuse it.

The answer is the fewest GPUs meeting the targets (ties: the most goodput per GPU); the
ranking puts those meeting first (by GPUs, then goodput per GPU) and the rest after (the
closest to meeting first: the largest share within the targets, then the smallest P99 over
its target). The frontier is the layouts no other beats on both a P99 latency and output
tokens per second per GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torchroof.api import config_of
from torchroof.config import PricingOptions, Workload, split_knobs
from torchroof.config.errors import OptionError
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.planning.layouts import ServingLayout
from torchroof.planning.serving_space import enumerate_serving, layout_label, serving_space
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.runtime import with_knobs
from torchroof.progress import current, reporting, silenced
from torchroof.serving.disaggregated import check_disaggregated, simulate_disaggregated
from torchroof.serving.rate_search import check_targets
from torchroof.serving.requests import Request
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.serve import deployment_timer, load_requests
from torchroof.serving.simulate import ROUTERS, check_fits, kv_capacity, simulate
from torchroof.serving.step_time import StepTimer

DEFAULT_MAX_PLANS = 400
"""Layouts simulated at most unless raised: each serves every request once."""
CHOSEN = ("tp", "pp", "ep", "dp", "kv_dtype", "replicas", "disaggregate", "prefill", "decode")
"""What the search chooses: given as a knob, it is refused (narrowed with ``space``)."""
LATENCIES = ("ttft", "tpot")


@dataclass(frozen=True)
class ServedPlan:
    """A layout and its figures at the searched load (``figures``: GPUs, the share of
    requests within the targets, P50/P99 TTFT and TPOT in seconds, output tokens/s and
    goodput per GPU); ``result`` is its whole simulated run."""

    layout: ServingLayout
    figures: dict[str, Any]
    result: ServeResult = field(repr=False, compare=False)

    @property
    def gpus(self) -> int:
        return self.layout.gpus

    @property
    def meets(self) -> bool:
        return bool(self.figures["meets"])

    @property
    def attainment(self) -> float:
        return float(self.figures["attainment"])

    @property
    def goodput_per_s_per_gpu(self) -> float:
        return float(self.figures["goodput_per_s_per_gpu"] or 0.0)

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return float(self.figures["output_tokens_per_s_per_gpu"] or 0.0)

    def p99(self, latency: str) -> float:
        """The P99 ``ttft`` or ``tpot`` in seconds (0 where no request has a TPOT)."""
        return float(self.figures[f"p99_{latency}_s"] or 0.0)

    def label(self) -> str:
        return layout_label(self.layout)

    def to_dict(self) -> dict[str, Any]:
        layout = {**vars(self.layout), "attention_dp": self.layout.attention_dp}
        return {"layout": self.label(), **layout, **self.figures}


@dataclass
class ServingPlans:
    """What a serving search found: every simulated layout, those meeting the targets
    first, and every layout left out, with why."""

    ranked: list[ServedPlan]
    rejected: Counter[str]  # a refused family's reason -> how many families
    ttft_s: float | None
    tpot_s: float | None
    attainment: float
    load: str  # "at 10 requests/s", "from 8 concurrent clients"
    gpus_max: int
    enumerated: int = 0  # layouts the space held that the model can be served with

    @property
    def meeting(self) -> list[ServedPlan]:
        return [plan for plan in self.ranked if plan.meets]

    @property
    def best(self) -> ServedPlan:
        """The fewest GPUs meeting the targets (ties: the most goodput per GPU)."""
        if not self.ranked or not self.ranked[0].meets:
            raise OptionError(self.nothing_meets())
        return self.ranked[0]

    def targets(self) -> str:
        """``TTFT <= 200 ms and TPOT <= 20 ms``."""
        given = [
            f"{name} <= {_ms(value)}"
            for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s))
            if value is not None
        ]
        return " and ".join(given)

    def nothing_meets(self) -> str:
        """Why there is no answer, in one line naming the closest layout and its P99s."""
        if not self.ranked:
            reasons = "; ".join(reason for reason, _ in self.rejected.most_common(3))
            return (
                "no serving layout to simulate: every one was refused "
                f"({reasons or 'none enumerated'})"
            )
        closest = self.ranked[0]
        return (
            f"no layout meets {self.targets()} for {self.attainment:.0%} of requests "
            f"{self.load} on up to {self.gpus_max} GPUs: the closest is {closest.label()} on "
            f"{closest.gpus} GPUs ({closest.attainment:.0%} within; P99 TTFT "
            f"{_p99(closest, 'ttft')}, P99 TPOT {_p99(closest, 'tpot')})"
        )

    def answer(self) -> str:
        """The search's answer in one line: the best plan, or why there is none."""
        if not self.meeting:
            return self.nothing_meets()
        best = self.best
        return (
            f"fewest GPUs meeting {self.targets()} for {self.attainment:.0%} of requests "
            f"{self.load}: {best.gpus} ({best.label()}; P99 TTFT {_p99(best, 'ttft')}, "
            f"P99 TPOT {_p99(best, 'tpot')})"
        )

    def frontier(self, latency: str = "tpot") -> list[ServedPlan]:
        """The simulated layouts no other beats on both the P99 ``latency`` (``ttft`` or
        ``tpot``) and output tokens per second per GPU, most throughput first."""
        if latency not in LATENCIES:
            raise OptionError(f"latency must be ttft or tpot, got {latency!r}")
        front: list[ServedPlan] = []
        by_throughput = sorted(
            self.ranked, key=lambda p: (-p.output_tokens_per_s_per_gpu, p.p99(latency))
        )
        for plan in by_throughput:  # keep one faster than every plan of more throughput
            if all(plan.p99(latency) < kept.p99(latency) for kept in front):
                front.append(plan)
        return front

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        return {
            "load": self.load,
            "targets": {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s},
            "attainment": self.attainment,
            "gpus_max": self.gpus_max,
            "answer": self.answer(),
            "best": self.best.to_dict() if self.meeting else None,
            "enumerated": self.enumerated,
            "simulated": len(self.ranked),
            "meeting": len(self.meeting),
            "ranked": [plan.to_dict() for plan in self.ranked[:top]],
            "frontier": {
                latency: [plan.label() for plan in self.frontier(latency)] for latency in LATENCIES
            },
            "rejected": dict(self.rejected),
        }


def plan_serving(
    model: Any,
    hardware: str | Path | ClusterSpec | HardwareSpec = "dgx-h100",
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    requests: int | str | Path | Sequence[Request] = 500,
    input_len: str | int = 1024,
    output_len: str | int = 128,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    attainment: float = 0.9,
    gpus_max: int | None = None,
    space: dict[str, Any] | None = None,
    engine: EngineConfig | None = None,
    burstiness: float = 1.0,
    random_state: int = 0,
    router: str = "round-robin",
    pricing: PricingOptions | None = None,
    exact_up_to: int | None = None,
    max_plans: int = DEFAULT_MAX_PLANS,
    progress: bool = False,
    **knobs: Any,
) -> ServingPlans:
    """Search the serving layouts of ``model`` on up to ``gpus_max`` GPUs of ``hardware``
    (default: one node of the cluster; one GPU of a lone accelerator) for ``requests`` at
    ``rate`` per second or from ``concurrency`` clients, as :func:`torchroof.serve` takes
    them, against the ``ttft_s`` / ``tpot_s`` targets met by ``attainment`` of requests.
    ``space`` narrows or widens what is searched (fields of
    :class:`~torchroof.planning.serving_space.ServingSpace`: ``{"tp": (2, 4), "kv_dtype":
    ("model", "fp8"), "disaggregate": ("1P1D",)}``); ``engine`` gives the scheduler knobs
    not searched (``gpu_memory_utilization``, ``block_size``, ...); ``knobs`` are the
    deployment's other workload fields (``dtype``, ``quant``) and pricing options
    (``mode``, ``runtime``, ...)."""
    if ttft_s is None and tpot_s is None:
        raise OptionError("a serving search needs a TTFT or a TPOT target (ttft_s, tpot_s)")
    check_targets(ttft_s, tpot_s, attainment)
    chosen = sorted(set(knobs) & set(CHOSEN))
    if chosen:
        raise OptionError(
            f"{', '.join(chosen)} is what the search chooses: narrow it with space={{...}}"
        )
    workload_knobs, pricing_knobs = split_knobs(knobs)  # an unknown knob refused here
    with_knobs(pricing, pricing_knobs)  # a bad mode, runtime, ... before anything is traced
    Workload(regime="decode", **workload_knobs)  # a bad dtype or quant likewise
    if router not in ROUTERS:
        raise OptionError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
    if exact_up_to is not None and (
        isinstance(exact_up_to, bool) or not isinstance(exact_up_to, int) or exact_up_to < 1
    ):
        raise OptionError(f"exact_up_to must be a whole number >= 1 or None, got {exact_up_to!r}")
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise OptionError(f"max_plans must be a whole number >= 1, got {max_plans!r}")
    _, cluster = resolve_hardware(hardware)
    node = cluster.gpus_per_node if cluster is not None else 1
    settings = serving_space(node if gpus_max is None else gpus_max, node, space)
    base = engine or EngineConfig()
    batch = load_requests(
        requests, rate, concurrency, (input_len, output_len, None), burstiness, random_state
    )
    if settings.disaggregate:
        check_disaggregated(batch, [base], hardware)
    enumeration = enumerate_serving(config_of(model), settings)
    quant = str(knobs.get("quant", "none"))
    layouts = [replace(layout, quant=quant) for layout in enumeration.layouts]
    if len(layouts) > max_plans:
        raise OptionError(
            f"{len(layouts):,} serving layouts to simulate, above max_plans={max_plans:,}: "
            "narrow the space (tp, replicas, dp, max_num_seqs, max_num_batched_tokens, "
            "kv_dtype) or raise max_plans"
        )
    result = ServingPlans(
        [], enumeration.rejected, ttft_s, tpot_s, attainment,
        _load(rate, concurrency), settings.gpus_max, len(layouts),
    )  # fmt: skip
    timers = _Timers(model, hardware, knobs, pricing, exact_up_to)
    run = _Runner(timers, batch, base, concurrency, router, random_state)
    with reporting(progress):
        _simulate_all(layouts, run, result)
    result.ranked.sort(key=lambda plan: _rank(plan, result))
    return result


@dataclass
class _Timers:
    """One step timer per engine shape (tp, ep, data-parallel attention ranks, KV dtype),
    built when first asked for: every layout of that shape shares it (its priced batches
    included)."""

    model: Any
    hardware: Any
    knobs: dict[str, Any]
    pricing: PricingOptions | None
    exact_up_to: int | None
    built: dict[tuple[int, int, int, str | None], StepTimer | str] = field(default_factory=dict)

    def get(self, tp: int, ep: int, kv_dtype: str | None, dp: int = 1) -> StepTimer | str:
        """The shape's timer, or why it could not be built (one line): rank 0 of ``dp``
        data-parallel attention ranks of ``tp`` GPUs where ``dp`` > 1."""
        key = (tp, ep, dp, kv_dtype)
        if key not in self.built:
            knobs = {**self.knobs, "tp": tp, "kv_dtype": kv_dtype or "model"}
            if ep > 1:
                knobs["ep"] = ep
            if dp > 1:
                knobs["dp"] = dp
            try:
                with silenced():
                    self.built[key] = deployment_timer(
                        self.model, self.hardware, knobs, self.pricing, self.exact_up_to, False
                    )
            except ValueError as error:  # OptionError, WorkloadError and kin
                self.built[key] = str(error).splitlines()[0]
        return self.built[key]


@dataclass
class _Runner:
    """What every simulation shares: the timers, the requests, the engine's unsearched
    knobs, the load and the router."""

    timers: _Timers
    batch: list[Request]
    base: EngineConfig
    concurrency: int | None
    router: str
    random_state: int
    fits: dict[tuple[Any, ...], str | None] = field(default_factory=dict)

    def engine(self, layout: ServingLayout) -> EngineConfig:
        return replace(
            self.base,
            max_num_seqs=layout.max_num_seqs,
            max_num_batched_tokens=layout.max_num_batched_tokens,
            chunked_prefill=layout.chunked_prefill,
        )

    def refusal(self, layout: ServingLayout) -> tuple[str, bool] | None:
        """Why one replicated engine of ``layout`` cannot serve the requests (its timer
        not built, or its KV cache short of one request), and whether that is the first
        layout of its family to ask; None where it can."""
        engine = self.engine(layout)
        dp = layout.attention_dp
        key = (layout.tp, layout.ep, dp, layout.kv_dtype, engine)
        if key in self.fits:
            known = self.fits[key]
            return None if known is None else (known, False)
        timer = self.timers.get(layout.tp, layout.ep, layout.kv_dtype, dp)
        shape = f"tp={layout.tp}" + (f" x dp={dp}" if dp > 1 else "")
        shape += f", kv {layout.kv_dtype}" if layout.kv_dtype else ""
        if isinstance(timer, str):
            reason: str | None = f"{shape}: {timer}"
        else:
            short = _kv_refusal(timer, engine, self.batch)
            reason = short and (
                f"{shape}, max_num_seqs={layout.max_num_seqs}, "
                f"max_num_batched_tokens={layout.max_num_batched_tokens}: {short}"
            )
        self.fits[key] = reason
        return None if reason is None else (reason, True)

    def simulate(self, layout: ServingLayout) -> ServeResult:
        """Serve the requests on ``layout`` (its timers built or refused before)."""
        engine = self.engine(layout)
        if layout.disaggregate is None:
            timer = self.timers.get(layout.tp, layout.ep, layout.kv_dtype, layout.attention_dp)
            assert not isinstance(timer, str)
            return simulate(
                timer, self.batch, engine=engine, concurrency=self.concurrency,
                replicas=layout.replicas, router=self.router, random_state=self.random_state,
            )  # fmt: skip
        sides = []
        for tp in (layout.prefill_tp, layout.decode_tp):
            timer = self.timers.get(tp, layout.ep, layout.kv_dtype)
            if isinstance(timer, str):
                raise OptionError(f"tp={tp}: {timer}")
            sides.append(timer)
        return simulate_disaggregated(
            (sides[0], sides[1]), self.batch, layout=str(layout.disaggregate),
            engines=(engine, engine), concurrency=self.concurrency, router=self.router,
        )  # fmt: skip


def _simulate_all(layouts: list[ServingLayout], run: _Runner, result: ServingPlans) -> None:
    """Simulate each layout into ``result``; a family that cannot serve the requests (a
    timer refused, a KV cache short of one request) is rejected once, with its reason."""
    if not layouts:
        return
    report = current()
    with report.stage(f"simulating {len(layouts):,} serving plans", len(layouts), "plans"):
        for layout in layouts:
            refused = run.refusal(layout) if layout.disaggregate is None else None
            if refused is not None:
                result.rejected[refused[0]] += refused[1]
                report.advance()
                continue
            try:
                with silenced():
                    served = run.simulate(layout)
            except OptionError as error:  # a disaggregated side's cache, a stuck engine
                result.rejected[f"{layout_label(layout)}: {str(error).splitlines()[0]}"] += 1
                report.advance()
                continue
            result.ranked.append(ServedPlan(layout, _figures(served, layout, result), served))
            report.advance()


def _kv_refusal(timer: StepTimer, engine: EngineConfig, batch: list[Request]) -> str | None:
    """Why an engine of ``timer`` cannot serve ``batch`` (a request longer than the model
    takes, or one whose KV outgrows the whole cache), as :func:`simulate` refuses it."""
    try:
        timer.check_lengths(batch)
        check_fits(batch, engine, kv_capacity(timer, engine))
    except OptionError as error:
        return str(error).splitlines()[0]
    return None


def _figures(served: ServeResult, layout: ServingLayout, plans: ServingPlans) -> dict[str, Any]:
    """The figures a plan is ranked by, from its run's summary."""
    summary = served.summary(plans.ttft_s, plans.tpot_s)
    gpus = layout.gpus
    share = summary["requests_meeting_slo"] / summary["requests"]
    output, goodput = summary["output_tokens_per_s"], summary["goodput_per_s"]
    return {
        "gpus": gpus,
        "meets": share >= plans.attainment,
        "attainment": share,
        "p50_ttft_s": summary["ttft_s"]["p50"],
        "p99_ttft_s": summary["ttft_s"]["p99"],
        "p50_tpot_s": summary["tpot_s"]["p50"],
        "p99_tpot_s": summary["tpot_s"]["p99"],
        "output_tokens_per_s_per_gpu": output / gpus if output is not None else None,
        "goodput_per_s_per_gpu": goodput / gpus if goodput is not None else None,
        "request_throughput_per_s": summary["request_throughput_per_s"],
        "preemptions": summary["preemptions"],
    }


def _rank(plan: ServedPlan, plans: ServingPlans) -> tuple[Any, ...]:
    """Meeting first, by GPUs then goodput per GPU; the rest closest first: the largest
    share within the targets, then the smallest P99 over its target, then fewer GPUs."""
    if plan.meets:
        return (0, plan.gpus, -plan.goodput_per_s_per_gpu, 0.0)
    over = max(
        plan.p99(latency) / target
        for latency, target in (("ttft", plans.ttft_s), ("tpot", plans.tpot_s))
        if target is not None
    )
    return (1, -plan.attainment, over, plan.gpus)


def _load(rate: float | None, concurrency: int | None) -> str:
    if rate is not None:
        return f"at {rate:g} requests/s"
    if concurrency is not None:
        return f"from {concurrency} concurrent clients"
    return "at the requests' own arrival times"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def _p99(plan: ServedPlan, latency: str) -> str:
    """A plan's P99 ``latency`` in ms, or "none" where no request has one (a TPOT needs
    two output tokens)."""
    seconds = plan.figures[f"p99_{latency}_s"]
    return "none" if seconds is None else _ms(float(seconds))
