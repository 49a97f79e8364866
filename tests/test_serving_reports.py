"""A serving run's pictures and page, and the load against the offered rate
(torchroof.serving.series, load_curve, plots, report; ``torchroof serve --plot / --html /
--rates``): the numbers each picture draws checked against the run's own, the knee's rule on
points derived by hand, the page's tables as the text prints them. On tests/conftest.py's
small Llama (2 layers, 512 B of K and V per token) priced on the H100 SXM's pure roofline,
as tests/test_serving_simulation.py does."""

import json
import re
import sys

import numpy as np
import pytest
from conftest import small_llama

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.render.serving_curves import knee_sentence
from torchroof.serving import StepTimer
from torchroof.serving.load_curve import LoadCurve, check_rates, find_knee, load_curve
from torchroof.serving.rate_search import RateSearch, RateTried
from torchroof.serving.requests import Arrivals, Lengths, Request, make_requests
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.series import ecdf, step_series
from torchroof.serving.simulate import simulate

pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install torchroof[plot])")
pytest.importorskip("plotly", reason="the page needs plotly (pip install torchroof[html])")

from torchroof.serving.plots import rate_figure, serving_figures, serving_plot  # noqa: E402
from torchroof.serving.report import (  # noqa: E402
    kv_figure,
    latency_figure,
    rate_curve_figure,
    serving_html,
)


@pytest.fixture(scope="module")
def timer():
    prepared = torchroof.prepare(small_llama(2), "decode", context=16)
    return StepTimer(prepared, "h100-sxm")


@pytest.fixture(scope="module")
def preempted(timer):
    """Four requests of 32 + 33 tokens at once on 15 KV blocks: the preemption
    test_serving_simulation derives by hand (one preemption, 49 steps, at most 12 blocks
    in use once the preempted request has freed its own)."""
    requests = [Request(i, 32, 33, 0.0) for i in range(4)]
    return simulate(timer, requests, engine=EngineConfig(num_gpu_blocks_override=15))


@pytest.fixture(scope="module")
def drawn():
    """50 requests of 64-256 prompt tokens and 8-32 output tokens at 1 per second."""
    return make_requests(
        50,
        Lengths.parse("uniform:64,256", "in"),
        Lengths.parse("uniform:8,32", "out"),
        Arrivals("poisson", 1.0),
        2,
    )


@pytest.fixture(scope="module")
def curve(timer, drawn):
    # on this model one request alone takes about 10 us: 2e4 per second barely overlap,
    # 1.6e5 per second queue
    return load_curve(timer, drawn, [2e4, 4e4, 1.6e5], ttft_s=20e-6, tpot_s=2e-6)


def test_the_cdf_is_the_sorted_values_with_their_ranks():
    x, cdf = ecdf(np.array([0.3, 0.1, 0.2, 0.1]))
    assert x.tolist() == [0.1, 0.1, 0.2, 0.3]
    assert cdf.tolist() == [0.25, 0.5, 0.75, 1.0]  # i / 4
    # ten values kept at four points: ranks ceil(j x 10 / 4) = 3, 5, 8, 10
    x, cdf = ecdf(np.arange(10.0)[::-1], points=4)
    assert x.tolist() == [2.0, 4.0, 7.0, 9.0] and cdf.tolist() == [0.3, 0.5, 0.8, 1.0]
    with pytest.raises(OptionError, match="points must be"):
        ecdf(np.arange(3.0), points=0)


def test_the_latency_plots_draw_every_value_at_its_rank(preempted):
    figures = serving_figures(preempted, ttft_slo_s=1e-5)
    try:
        ttft_axes = figures["latency"].axes[0]
        ttft = np.sort(preempted.latencies("ttft_s"))
        line = ttft_axes.lines[0]
        assert np.array_equal(line.get_xdata(), ttft * 1e3)
        assert np.array_equal(line.get_ydata(), np.arange(1, 5) / 4)
        # the TTFT target is the dashed line at 10 us = 0.01 ms
        assert ttft_axes.lines[1].get_xdata()[0] == pytest.approx(0.01)
        itl = figures["latency"].axes[2].lines[0]
        assert len(itl.get_xdata()) == len(preempted.itl_s)
        kv = figures["kv_cache"].axes[0].lines[0]
        assert np.allclose(kv.get_ydata(), preempted.steps.blocks_used / 15 * 100)
    finally:
        import matplotlib.pyplot as plt

        for fig in figures.values():
            plt.close(fig)


def test_the_kv_series_is_blocks_used_over_the_cache_step_by_step(preempted):
    series = step_series(preempted)
    steps = preempted.steps
    assert len(series) == 49  # 33 steps, 1 recomputing the preempted request, 15 decodes
    assert np.array_equal(series.kv_share, steps.blocks_used / 15)
    # the first step prefills the four 32-token prompts, 2 blocks each: 8 of 15 in use
    assert series.kv_share[0] == 8 / 15
    assert (series.prefill_tokens[0], series.decode_tokens[0], series.sequences[0]) == (128, 0, 4)
    # then four decodes a step until one is preempted; at most 12 blocks in use after
    assert (series.prefill_tokens[1], series.decode_tokens[1]) == (0, 4)
    assert series.kv_share.max() == 12 / 15
    assert np.array_equal(series.prefill_tokens + series.decode_tokens, steps.tokens)
    # preemptions so far: 0 until the one preemption, then 1 to the end
    assert series.preemptions[0] == 0 and series.preemptions[-1] == 1
    assert np.all(np.diff(series.preemptions) >= 0)


def test_the_knee_is_the_last_rate_before_the_p99_passes_k_times_alone():
    # P99 TTFT 0.1 s one at a time, factor 3: the threshold is 0.3 s; the first rate past
    # it is 8 (0.31 s), so the knee is 4, whatever order the points come in
    knee = find_knee([16, 4, 1, 8, 2], [2.0, 0.25, 0.10, 0.31, 0.12], 0.1, 3.0)
    assert (knee.rate, knee.first_past, knee.first_past_s) == (4, 8, 0.31)
    assert knee.threshold_s == pytest.approx(0.3)
    assert knee_sentence(knee.to_dict()) == (
        "knee: 4 requests/s, the last rate before the P99 TTFT passes 3x its 100 ms one at a "
        "time, 300 ms (at 8 requests/s it is 310 ms)"
    )
    # the first crossing counts, even where a higher rate comes back under
    assert find_knee([1, 2, 4], [0.1, 0.35, 0.2], 0.1, 3.0).rate == 1
    # every rate within: the highest, not reached; none within: below the lowest
    within = find_knee([1, 2], [0.1, 0.2], 0.1)
    assert (within.rate, within.first_past) == (2, None)
    assert "not reached" in knee_sentence(within.to_dict())
    past = find_knee([1, 2], [0.5, 0.9], 0.1)
    assert (past.rate, past.first_past) == (None, 1)
    assert knee_sentence(past.to_dict()).startswith("knee: below 1 requests/s")
    with pytest.raises(OptionError, match="above 1"):
        find_knee([1], [0.1], 0.1, factor=1.0)


def test_the_curve_serves_the_same_requests_retimed(timer, drawn, curve):
    assert [p.rate for p in curve.points] == [2e4, 4e4, 1.6e5]
    # each rate is a whole simulation of the requests, their arrivals scaled by 1 / rate
    retimed = [Request(r.index, r.input_len, r.output_len, r.arrival_s / 4e4) for r in drawn]
    again = simulate(timer, retimed)
    assert json.dumps(again.to_dict()) == json.dumps(curve.points[1].result.to_dict())
    # and first one at a time: one closed-loop client, so no request ever waits
    assert curve.alone.result.summary()["queue_s"]["p99"] == 0.0
    rows = curve.rows()
    summary = curve.points[2].result.summary(20e-6, 2e-6)
    assert rows[2]["p99_ttft_s"] == summary["ttft_s"]["p99"]
    assert rows[2]["goodput_per_s"] == summary["goodput_per_s"]
    assert rows[2]["within_targets"] == summary["requests_meeting_slo"] / 50
    # the P99 TTFT grows with the rate
    assert rows[0]["p99_ttft_s"] < rows[2]["p99_ttft_s"]
    knee = curve.knee()
    assert knee.baseline_s == curve.alone.result.summary()["ttft_s"]["p99"]
    assert curve.to_dict()["knee"] == knee.to_dict()
    for bad, message in (([], "list of numbers"), ([1.0, 0.0], "above 0"), ([2, 1, 2], "twice")):
        with pytest.raises(OptionError, match=message):
            check_rates(bad)


def test_a_rate_search_gives_its_open_rates_in_order(curve):
    run = curve.points[0].result
    tried = (
        RateTried(7.0, 1.0, curve.alone.result, "one at a time"),
        RateTried(float("inf"), 0.0, run, "all at once"),
        RateTried(1.0, 1.0, run),
        RateTried(2.0, 0.5, run),
        RateTried(1.5, 1.0, run),
    )
    search = RateSearch(tried[4], tried, 20e-6, None, 0.9)
    found = LoadCurve.from_search(search)
    assert [p.rate for p in found.points] == [1.0, 1.5, 2.0]  # every request at once left out
    assert found.alone.rate == 7.0 and (found.ttft_s, found.tpot_s) == (20e-6, None)


def test_the_rate_plot_draws_each_rate_served(curve):
    fig = rate_figure(curve)
    try:
        throughput, ttft, _ = fig.axes[:3]
        rows = curve.rows()
        assert list(throughput.lines[0].get_xdata()) == [2e4, 4e4, 1.6e5]
        assert list(throughput.lines[0].get_ydata()) == [
            r["request_throughput_per_s"] for r in rows
        ]
        assert np.allclose(ttft.lines[1].get_ydata(), [r["p99_ttft_s"] * 1e3 for r in rows])
        # the TTFT target (20 us) and the knee's threshold, 3x the P99 one at a time
        levels = [line.get_ydata()[0] for line in ttft.lines[2:4]]
        assert levels == pytest.approx([0.02, 3 * curve.knee().baseline_s * 1e3])
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_page_is_offline_and_holds_the_summary_as_printed(preempted, curve, tmp_path):
    path = tmp_path / "run.html"
    page = serving_html(preempted, path, ttft_slo_s=1e-5, curve=curve)
    assert path.read_text() == page
    markup = re.sub(r"<script[^>]*>.*?</script>", "", page, flags=re.DOTALL)
    assert not re.search(r"(src|href|url)\s*[=(]", markup) and "<link" not in markup
    summary = preempted.summary(ttft_slo_s=1e-5)
    for value in (summary["ttft_s"]["p99"], summary["e2e_s"]["mean"]):
        assert re.search(rf"<td>\s*{value * 1e3:.2f}\s*</td>", page)
    assert re.search(r"<td>\s*KV cache peak in use\s*</td><td>\s*80\.0%", page)  # 12 of 15
    assert re.search(r"<td>\s*preemptions\s*</td><td>\s*1\s*</td>", page)
    assert knee_sentence(curve.to_dict()["knee"]) in page
    for name in ("latency", "kv-cache", "batches", "rates"):
        assert f'id="{name}"' in page
    # the same inputs give the same bytes
    assert serving_html(preempted, None, ttft_slo_s=1e-5, curve=curve) == page


def test_the_page_figures_hold_the_runs_numbers(preempted, curve):
    cdf = latency_figure(preempted).data[0]
    assert np.array_equal(cdf.x, np.sort(preempted.latencies("ttft_s")) * 1e3)
    assert np.array_equal(cdf.y, np.arange(1, 5) / 4)
    kv = kv_figure(preempted).data[0]
    assert np.allclose(kv.y, preempted.steps.blocks_used / 15 * 100)
    rates = rate_curve_figure(curve).data
    assert list(rates[0].x) == [2e4, 4e4, 1.6e5]


def test_serve_writes_the_plot_the_page_and_the_rates(preempted, tmp_path, capsys):
    png, page, data = tmp_path / "rates.png", tmp_path / "rates.html", tmp_path / "rates.json"
    config = tmp_path / "config.json"
    small_llama(2).to_json_file(config)
    outputs = ["--json", str(data), "--plot", str(png), "--html", str(page), "--quiet"]
    flags = ["--requests", "20", "--input-len", "64", "--output-len", "4", "--ttft-ms", "1"]
    assert main(["serve", str(config), *flags, "--rates", "4e4,2e4", *outputs]) == 0
    text = capsys.readouterr().out
    assert "one at a time" in text and "knee: " in text
    found = json.loads(data.read_text())
    assert [row["rate"] for row in found["rates"]] == [2e4, 4e4]
    # no expected range for a served run, and why: the load curve says it too
    assert found["expected"]["none"].startswith("the 36 published serving runs")
    assert f"expected: no range, {found['expected']['none']}" in text
    assert knee_sentence(found["knee"]) in text and knee_sentence(found["knee"]) in page.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one run's panels, as --plot writes them without --rates
    svg = serving_plot(preempted, tmp_path / "run.svg")
    assert svg.read_text().count("<svg") == 1


def test_bad_report_options_are_answered_in_one_line(preempted, tmp_path, capsys, monkeypatch):
    cases = [
        (["--rate", "1", "--plot", str(tmp_path / "a.jpg")], "plots are written as .pdf"),
        (["--rate", "1", "--html", str(tmp_path / "a.txt")], "written to a .html file"),
        (["--rate", "1", "--plot", str(tmp_path / "no" / "a.png")], "no folder"),
        (["--rates", "1,0"], "rates must be above 0"),
        (["--rates", "1,1"], "the rate 1 is listed twice"),
        (["--rates", "1", "--rate", "2"], "--rate, --concurrency and --sweep-rate are not"),
        (["--rates", "1", "--csv", str(tmp_path / "a.csv")], "use --json with --rates"),
        (["--rate", "1", "--knee-factor", "2"], "--knee-factor is the knee's rule"),
        (["--rates", "1", "--knee-factor", "1"], "the knee factor must be above 1"),
    ]
    for flags, message in cases:
        assert main(["serve", "gpt2", "--requests", "4", "--quiet", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (flags, err)
    with pytest.raises(OptionError, match="the ttft target must be above 0 seconds"):
        torchroof.serving.serve_rates("gpt2", rates=[1.0], ttft_s=-1.0)  # before any tracing
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without the plot extra
    assert main(["serve", "gpt2", "--rate", "1", "--plot", str(tmp_path / "a.png")]) == 2
    assert "plots need matplotlib: pip install 'torchroof[plot]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match="plots need matplotlib"):
        serving_plot(preempted, tmp_path / "a.png")
    monkeypatch.setitem(sys.modules, "plotly.offline", None)
    assert main(["serve", "gpt2", "--rate", "1", "--html", str(tmp_path / "a.html")]) == 2
    assert "the HTML report needs plotly" in capsys.readouterr().err


def test_the_page_draws_in_a_browser(preempted, curve, tmp_path):
    from torchroof.render.browser import console_errors, open_chromium

    try:
        browser = open_chromium()
    except RuntimeError as error:
        pytest.skip(f"no headless browser for the page's test: {error}")
    path = tmp_path / "run.html"
    serving_html(preempted, path, curve=curve)
    try:
        from selenium.webdriver.support.ui import WebDriverWait

        browser.get(path.resolve().as_uri())
        drawn = "return document.querySelectorAll('.js-plotly-plot').length"
        WebDriverWait(browser, 60).until(lambda b: b.execute_script(drawn) == 4)
        assert console_errors(browser) == []
        read = (
            "const g = document.getElementById(arguments[0]);"
            "return Array.from(g._fullData[0][arguments[1]])"
        )
        # plotly.js holds the numbers Python gave it: the TTFT CDF and replica 0's KV share
        ttft = np.sort(preempted.latencies("ttft_s")) * 1e3
        assert browser.execute_script(read, "latency", "x") == pytest.approx(
            ttft.tolist(), rel=1e-15
        )
        kv = (preempted.steps.blocks_used / 15 * 100).tolist()
        assert browser.execute_script(read, "kv-cache", "y") == pytest.approx(kv, rel=1e-15)
        assert browser.execute_script(read, "rates", "x") == [2e4, 4e4, 1.6e5]
    finally:
        browser.quit()


def test_a_rate_search_reports_the_knee_of_the_rates_it_served(tmp_path, capsys):
    config, data, page = tmp_path / "config.json", tmp_path / "search.json", tmp_path / "s.html"
    small_llama(2).to_json_file(config)
    flags = ["--requests", "20", "--input-len", "64", "--output-len", "4", "--ttft-ms", "0.003"]
    outputs = ["--json", str(data), "--html", str(page), "--quiet"]
    assert main(["serve", str(config), "--sweep-rate", *flags, *outputs]) == 0
    found = json.loads(data.read_text())
    # the knee is the rule applied to the open-arrival rates the search tried
    opened = [t for t in found["tried"] if not t["how"]]
    alone = found["tried"][0]
    assert alone["how"] == "one at a time"
    knee = find_knee(
        [t["rate"] for t in opened], [t["p99_ttft_s"] for t in opened], alone["p99_ttft_s"]
    )
    assert found["knee"] == knee.to_dict()
    # and it is found among the search's doublings from 1 per second: on this model the
    # P99 TTFT passes 3x its value alone between 2^20 and 2^21 per second (observed)
    assert (found["knee"]["rate"], found["knee"]["first_past"]) == (2.0**20, 2.0**21)
    text = capsys.readouterr().out
    assert knee_sentence(found["knee"]) in text
    assert "The run shown:" in page.read_text()
    assert f"expected: no range, {found['expected']['none']}" in text
