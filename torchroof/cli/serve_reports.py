"""``torchroof serve``'s pictures and page, and its list of rates: ``--plot`` (one file of
panels for a run, the curves against the rate for ``--rates`` or ``--sweep-rate``),
``--html`` (the run's page, with the curves where rates were served), ``--rates`` (the same
requests at each rate listed) and ``--knee-factor`` (the knee's rule)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.cli.common import wrote
from torchroof.render.serving_curves import knee_sentence, rate_curve_lines

if TYPE_CHECKING:
    from torchroof.serving.load_curve import LoadCurve
    from torchroof.serving.rate_search import RateSearch
    from torchroof.serving.results import ServeResult


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are numbers per second, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be above 0 per second, got {text!r}")
    return rates


def add_report_flags(srv: argparse.ArgumentParser, out: Any) -> None:
    """``--rates`` and ``--knee-factor`` in a group of their own, ``--plot`` and
    ``--html`` in the output group ``out``."""
    load = srv.add_argument_group("against the offered rate")
    load.add_argument(
        "--rates",
        type=_rates,
        metavar="R1,R2,...",
        help="serve the same requests one at a time, then at each rate listed (requests per "
        "second; instead of --rate or --concurrency): latency and throughput against the "
        "rate, and the knee",
    )
    load.add_argument(
        "--knee-factor",
        type=float,
        metavar="K",
        default=3.0,
        help="the knee is the last rate before the P99 TTFT passes this many times its value "
        "one at a time (3), with --rates or --sweep-rate",
    )
    out.add_argument(
        "--plot",
        metavar="PATH",
        help="a run's latency CDFs, KV cache and batches over time, in panels of one file; "
        "with --rates or --sweep-rate, throughput and latency against the rate (.png/.svg/.pdf)",
    )
    out.add_argument(
        "--html",
        metavar="PATH",
        help="the run's page (summary, CDFs, time series; the rate curves where rates were "
        "served), one offline file",
    )


def check_reports(args: argparse.Namespace) -> None:
    """Refuse, before any work, a plot or page that cannot be written and flags that do
    not go together."""
    from torchroof.render.files import check_html_path
    from torchroof.serving.load_curve import check_factor
    from torchroof.serving.plots import check_serving_plot

    given: set[str] = getattr(args, "given", set())
    if args.rates is not None:
        if args.sweep_rate or args.rate is not None or args.concurrency is not None:
            raise ValueError(
                "--rates serves the rates listed: --rate, --concurrency and --sweep-rate are "
                "not taken with it"
            )
        if args.csv:
            raise ValueError("--csv writes one row per request of one run: use --json with --rates")
    if "knee_factor" in given and args.rates is None and not args.sweep_rate:
        raise ValueError("--knee-factor is the knee's rule for --rates or --sweep-rate: give one")
    check_factor(args.knee_factor)
    if args.plot:
        check_serving_plot(args.plot)
    if args.html:
        check_html_path(args.html)


def write_run_reports(
    args: argparse.Namespace, result: ServeResult, ttft: float | None, tpot: float | None
) -> None:
    """One run's ``--plot`` and ``--html``."""
    if args.plot:
        from torchroof.serving.plots import serving_plot

        serving_plot(result, args.plot, ttft, tpot)
        wrote("the run's plots", args.plot)
    if args.html:
        from torchroof.serving.report import serving_html

        serving_html(result, args.html, ttft, tpot)
        wrote("the run's page (HTML)", args.html)


def _curve_reports(
    args: argparse.Namespace, curve: LoadCurve, shown: ServeResult, about: str
) -> None:
    if args.plot and curve.rows():
        from torchroof.serving.plots import rate_plot

        rate_plot(curve, args.plot, args.knee_factor)
        wrote("the curves against the rate", args.plot)
    elif args.plot:  # no open-arrival rate to draw a curve through: the run shown
        from torchroof.serving.plots import serving_plot

        serving_plot(shown, args.plot, curve.ttft_s, curve.tpot_s)
        wrote("the shown run's plots (no rate served at open arrivals to draw curves)", args.plot)
    if args.html:
        from torchroof.serving.report import serving_html

        serving_html(
            shown, args.html, curve.ttft_s, curve.tpot_s, curve, args.knee_factor, about=about
        )
        wrote("the page (HTML)", args.html)


def run_rates(
    args: argparse.Namespace,
    deployment: dict[str, Any],
    hardware: str,
    ttft: float | None,
    tpot: float | None,
) -> None:
    """``--rates``: the requests one at a time, then at each rate; the knee; the page
    shows the knee's run (or the lowest rate's, where the knee is below it)."""
    from torchroof.serving.serve import serve_rates

    curve = serve_rates(
        args.model, hardware, rates=args.rates, ttft_s=ttft, tpot_s=tpot, **deployment
    )
    data = curve.to_dict(args.knee_factor)
    print("\n".join(rate_curve_lines(data)))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        wrote("the rates", args.json)
    knee = data["knee"]["rate"]
    point = next((p for p in curve.points if p.rate == knee), curve.points[0])
    if knee is None:
        what = "the lowest rate served (the knee is below it)"
    elif data["knee"]["first_past"] is None:
        what = "the highest rate served (no rate passed the knee's threshold)"
    else:
        what = "the knee"
    _curve_reports(
        args, curve, point.result, f"The run shown: {point.rate:,.4g} requests/s, {what}."
    )


def search_reports(args: argparse.Namespace, found: RateSearch, data: dict[str, Any]) -> None:
    """``--sweep-rate``: the knee of the rates searched (printed and put in ``data``, the
    search's JSON), and the plot and page of the search; the page shows the best rate's
    run, or the requests one at a time where no rate meets the targets."""
    from torchroof.serving.load_curve import LoadCurve

    curve = LoadCurve.from_search(found)
    data["knee"] = curve.knee(args.knee_factor).to_dict()
    print(knee_sentence(data["knee"]))
    if found.best is None:
        shown, about = found.tried[0], "the requests one at a time (no rate meets the targets)"
    elif found.best.how:
        shown, about = found.best, "every request at once (no rate limits the targets)"
    else:
        shown, about = (
            found.best,
            f"{found.best.rate:,.4g} requests/s, the highest within the targets",
        )
    if args.plot or args.html:
        _curve_reports(args, curve, shown.result, f"The run shown: {about}.")
