"""The interactive HTML report in a real headless browser: Debian's chromium,
driven by selenium through Debian's chromedriver. The page loads without console errors,
its charts draw, switching the accelerator or moving a slider re-prices every kernel to
exactly what Python computes, and a layer row expands into its kernels.

Skipped, with the reason, where the browser or its driver is not installed (``.ci/run``
installs them where it can: ``apt-get install chromium chromium-driver``)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest

import torchroof

pytest.importorskip("plotly", reason="the HTML report needs plotly (pip install torchroof[html])")
from torchroof.hardware import available, get_cluster

from torchroof.api import estimate_trace, trace_model
from torchroof.render.browser import console_errors, open_chromium
from torchroof.render.html import comparison_html, estimate_html, sweep_html
from torchroof.report.compare import Sweep, SweepPoint

# A Llama large enough that a step takes milliseconds, so the printed ms digits differ
# between accelerators (the trace is on meta: nothing is allocated).
MID_LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
)


@pytest.fixture(scope="module")
def browser():
    try:
        driver = open_chromium()
    except RuntimeError as error:
        pytest.skip(f"no headless browser for the HTML report's tests: {error}")
    yield driver
    driver.quit()


def load(browser, path: Path) -> None:
    """Open ``path`` and wait until the page has drawn itself once (a loaded CI machine can
    take seconds over a 5 MB page)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(path.resolve().as_uri())
    body = browser.find_element(By.TAG_NAME, "body")
    WebDriverWait(browser, 60).until(
        lambda _: body.get_attribute("data-rendered") or errors_now(browser)
    )


def errors_now(browser) -> bool:
    """Stop waiting on a page whose script failed (its errors stay for the test to read)."""
    return bool(browser.execute_script("return document.readyState === 'complete'")) and not (
        browser.find_elements("css selector", "#app > *")
    )


def open_page(browser, path: Path) -> None:
    load(browser, path)
    browser.get_log("browser")  # the page's load messages are checked where asked


def errors(browser) -> list[str]:
    return console_errors(browser)


def select(browser, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, element_id)).select_by_value(value)


def priced(browser, name: str, view: int = 0, compute: float = 1, bandwidth: float = 1) -> dict:
    """The page's pricing of estimate ``view`` on accelerator ``name`` at the given
    efficiencies (window.torchroofPrice)."""
    script = "return window.torchroofPrice(arguments[0], arguments[1], arguments[2], arguments[3])"
    return browser.execute_script(script, view, name, compute, bandwidth)


def text(browser, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.ID, element_id).text


def slide(browser, element_id: str, value: float) -> None:
    """Move a range input as a user would: its value, then the input event."""
    browser.execute_script(
        "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
        "s.dispatchEvent(new Event('input'));",
        element_id,
        str(value),
    )


@pytest.fixture(scope="module")
def prefill_trace():
    from conftest import meta_causal_lm

    return trace_model(meta_causal_lm("llama", **MID_LLAMA), regime="prefill", seq=1024)


@pytest.fixture(scope="module")
def prefill_page(prefill_trace, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("html") / "prefill.html"
    estimate_html(estimate_trace(prefill_trace, "h100-sxm"), path)
    return path


def test_the_page_loads_without_errors_and_draws_its_charts(browser, prefill_page, tmp_path):
    from matplotlib.image import imread
    from selenium.webdriver.common.by import By

    load(browser, prefill_page)
    assert errors(browser) == []
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == "1"
    # each chart holds plotted data and plotly drew it (its div carries the SVG)
    for chart in ("layers-chart", "traffic-chart", "roofline-chart", "timeline-chart"):
        traces = browser.execute_script(
            "const d = document.getElementById(arguments[0]);"
            "return d.querySelector('.main-svg') ? (d.data || []).length : -1;",
            chart,
        )
        assert traces > 0, f"{chart} did not draw ({traces})"
    points = browser.find_elements(By.CSS_SELECTOR, "#roofline-chart .scatterlayer .point")
    assert points, "the roofline shows the kernels as points"
    png = browser.get_screenshot_as_png()
    (tmp_path / "page.png").write_bytes(png)
    pixels = imread(io.BytesIO(png))[..., :3]
    not_white = (pixels < 0.95).any(axis=-1).mean()
    colours = len({tuple(p) for p in (pixels[::4, ::4] * 255).astype(int).reshape(-1, 3)})
    assert not_white > 0.05, f"the screenshot is blank ({not_white:.1%} drawn)"
    assert colours > 50, f"the screenshot has only {colours} colours"


def test_switching_the_accelerator_gives_pythons_total(browser, prefill_trace, prefill_page):
    open_page(browser, prefill_page)
    h100 = estimate_trace(prefill_trace, "h100-sxm")
    assert text(browser, "step-time") == f"{h100.time_s * 1e3:.3f} ms"
    a100 = estimate_trace(prefill_trace, "a100-sxm")
    select(browser, "accelerator", "a100-sxm")
    assert text(browser, "step-time") == f"{a100.time_s * 1e3:.3f} ms"
    assert text(browser, "step-time") != f"{h100.time_s * 1e3:.3f} ms"
    assert text(browser, "mfu") == f"{100 * a100.mfu:.1f}%"
    assert "A100" in text(browser, "summary-accelerator")
    # every shipped accelerator, every kernel: the same doubles as Python
    for spec in available():
        python = estimate_trace(prefill_trace, spec)
        page = priced(browser, spec.name)
        assert page["note"] == ""
        assert page["step"] == python.time_s, spec.name
        assert page["time"] == [k.time_s for k in python.kernels], spec.name
    assert errors(browser) == []


def test_the_efficiency_sliders_reprice_as_python_does(browser, prefill_trace, prefill_page):
    open_page(browser, prefill_page)
    select(browser, "accelerator", "l40s")
    slide(browser, "compute-efficiency", 0.5)
    slide(browser, "bandwidth-efficiency", 0.8)
    python = estimate_trace(prefill_trace, "l40s", compute_efficiency=0.5, bandwidth_efficiency=0.8)
    assert text(browser, "step-time") == f"{python.time_s * 1e3:.3f} ms"
    assert text(browser, "compute-efficiency-value") == "50%"
    page = priced(browser, "l40s", compute=0.5, bandwidth=0.8)
    assert page["step"] == python.time_s
    assert page["time"] == [k.time_s for k in python.kernels]
    assert errors(browser) == []


def test_a_layer_row_expands_into_its_kernels(browser, prefill_trace, prefill_page):
    from selenium.webdriver.common.by import By

    open_page(browser, prefill_page)
    est = estimate_trace(prefill_trace, "h100-sxm")
    rows = est.rows(collapse=True)
    position = next(i for i, row in enumerate(rows) if row.kernels > 5)
    assert browser.find_elements(By.CSS_SELECTOR, "tr.kernel-row") == []
    browser.find_elements(By.CSS_SELECTOR, "tr.layer-row")[position].click()
    listed = browser.find_elements(By.CSS_SELECTOR, "tr.kernel-row:not(.kernel-header)")
    blocks = int(rows[position].name.rsplit("(x", 1)[1][:-1]) if "(x" in rows[position].name else 1
    # the row's kernels, or its first block's in a collapsed run (plus a line saying so)
    assert len(listed) == rows[position].kernels // blocks + (blocks > 1)
    browser.find_elements(By.CSS_SELECTOR, "tr.layer-row")[position].click()
    assert browser.find_elements(By.CSS_SELECTOR, "tr.kernel-row") == []


@pytest.mark.parametrize("gpus_per_node", [8, 2])
def test_a_multi_gpu_step_is_relaid_on_its_schedule(browser, tmp_path, gpus_per_node):
    """FSDP 2 x TP 2 training on a DGX H100 (and on nodes of two, where FSDP's collectives
    cross the network on their own stream beside tensor parallel's): the same links with
    another GPU re-prices the kernels and re-lays the schedule (collectives keep their
    network time) exactly as Python does with the cluster's accelerator replaced."""
    from conftest import meta_causal_lm

    model = meta_causal_lm("llama", **MID_LLAMA)
    from selenium.webdriver.common.by import By

    from torchroof.report import analysis

    trace = trace_model(model, regime="train", seq=512, fsdp=2, tp=2)
    cluster = replace(get_cluster("dgx-h100"), gpus_per_node=gpus_per_node)
    path = tmp_path / "fsdp.html"
    estimate_html(estimate_trace(trace, cluster), path)
    load(browser, path)
    assert errors(browser) == []
    for name in ("a100-sxm", "h200-sxm"):
        spec = next(s for s in available() if s.name == name)
        python = estimate_trace(trace, replace(cluster, accelerator=spec))
        page = priced(browser, name)
        assert page["step"] == python.time_s
        # each collective's share of the compute stream's waits, as Python charged it
        assert page["exposed"] == [k.exposed_s for k in python.kernels]
        select(browser, "accelerator", name)
        assert text(browser, "step-time") == f"{python.time_s * 1e3:.3f} ms"
        # four GPUs, two per replica (tp 2): throughput per GPU as the text summary gives it
        per_gpu = analysis.tokens_per_s_per_gpu(python)
        assert text(browser, "tokens-per-s").startswith(f"{per_gpu:,.1f} tokens/s per GPU")
        # the layer table's shares are of the kernels' summed time, as the text table's
        shares = [
            float(row.find_elements(By.TAG_NAME, "td")[5].text.rstrip("%"))
            for row in browser.find_elements(By.CSS_SELECTOR, "tr.layer-row")
        ]
        assert sum(shares) == pytest.approx(100, abs=0.1 * len(shares))


def test_a_realistic_estimate_keeps_its_numbers_and_says_why(browser, prefill_trace, tmp_path):
    realistic = estimate_trace(prefill_trace, "h100-sxm", mode="realistic")
    path = tmp_path / "realistic.html"
    estimate_html(realistic, path)
    load(browser, path)
    select(browser, "accelerator", "a100-sxm")
    assert text(browser, "step-time") == f"{realistic.time_s * 1e3:.3f} ms"
    assert "realistic mode" in text(browser, "pricing-note")
    assert errors(browser) == []


def test_sweep_and_compare_pages_show_their_variants(browser, tmp_path):
    from conftest import meta_causal_lm
    from selenium.webdriver.common.by import By

    model = meta_causal_lm("llama", **MID_LLAMA)
    points = [
        SweepPoint(b, estimate_trace(trace_model(model, regime="decode", batch=b, context=512)))
        for b in (1, 8, 64)
    ]
    sweep = Sweep("batch", points)
    path = tmp_path / "sweep.html"
    sweep_html(sweep, path)
    load(browser, path)
    assert errors(browser) == []
    rows = browser.find_elements(By.CSS_SELECTOR, "#variants-table tr.variant-row")
    times = [row.find_element(By.CSS_SELECTOR, ".variant-time").text for row in rows]
    assert times == [f"{p.estimate.time_s * 1e3:.3f}" for p in points]
    legend = browser.find_element(By.ID, "sweep-chart").text
    assert f"B* ≈ {sweep.ridge_batch:.0f}" in legend
    assert f"KV crossover ≈ {sweep.kv_crossover_batch:.0f}" in legend
    select(browser, "variant", "2")  # the details below follow the chosen point
    assert text(browser, "step-time") == f"{points[2].estimate.time_s * 1e3:.3f} ms"
    assert errors(browser) == []


def test_a_comparison_is_repriced_variant_by_variant(browser, prefill_trace, tmp_path):
    """compare over hardware: 'as estimated' keeps each variant's own accelerator; switching
    prices every variant on the one chosen, each from its own kernels."""
    from selenium.webdriver.common.by import By

    from torchroof.report.compare import Comparison, Variant

    variants = [
        Variant(f"hardware={name}", {"hardware": name}, estimate_trace(prefill_trace, name))
        for name in ("h100-sxm", "a100-sxm")
    ]
    path = tmp_path / "compare.html"
    comparison_html(Comparison(variants), path)
    load(browser, path)

    def times() -> list[str]:
        cells = browser.find_elements(By.CSS_SELECTOR, "#variants-table .variant-time")
        return [cell.text for cell in cells]

    assert times() == [f"{v.estimate.time_s * 1e3:.3f}" for v in variants]
    select(browser, "accelerator", "l4")
    l4 = f"{estimate_trace(prefill_trace, 'l4').time_s * 1e3:.3f}"
    assert times() == [l4, l4]
    assert errors(browser) == []


def test_markup_in_the_data_stays_text(browser, prefill_trace, tmp_path):
    """A module name, label or assumption holding '</script>' or '<!--<script' must neither
    end the data early nor keep it from ending (either would leave the page blank)."""
    from selenium.webdriver.common.by import By

    markup = ["</script><script>alert(1)</script>", "<!--<script>", "a & b > c"]
    path = tmp_path / "markup.html"
    estimate_html(replace(estimate_trace(prefill_trace, "h100-sxm"), assumptions=markup), path)
    load(browser, path)
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == "1"
    shown = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#assumption-list li")]
    assert shown == markup
    assert errors(browser) == []


def test_a_file_of_its_own_under_a_shipped_name_is_not_repriced(browser, prefill_trace, tmp_path):
    """An estimate priced on a user's copy of h100-sxm at half the bandwidth: the page has
    only the shipped file of that name, so moving a slider keeps the estimate and says why."""
    from torchroof.hardware import get

    shipped = get("h100-sxm")
    mine = replace(shipped, hbm_bytes_per_s=replace(shipped.hbm_bytes_per_s, value=1.675e12))
    est = estimate_trace(prefill_trace, mine)
    path = tmp_path / "mine.html"
    estimate_html(est, path)
    load(browser, path)
    slide(browser, "compute-efficiency", 0.9)
    assert text(browser, "step-time") == f"{est.time_s * 1e3:.3f} ms"
    assert "other figures than the shipped file" in text(browser, "pricing-note")
    assert errors(browser) == []


def test_a_grid_page_slides_to_each_point_and_reprices_it_as_python_does(browser, tmp_path):
    """batch (1, 8) x context (256, 1024) decode: moving the two sliders to a point shows
    that point's report (its step time as Python priced it), the heat map holds every
    point, and on another accelerator each point's page total is a fresh estimate's there,
    to the last digit."""
    from conftest import meta_causal_lm
    from selenium.webdriver.common.by import By

    from torchroof.render.html import grid_html
    from torchroof.studies import sweep_grid

    model = meta_causal_lm("llama", **MID_LLAMA)
    grid = sweep_grid(model, {"batch": [1, 8], "context": [256, 1024]}, regime="decode")
    path = tmp_path / "grid.html"
    grid_html(grid, path)
    load(browser, path)
    assert errors(browser) == []
    assert browser.find_elements(By.CSS_SELECTOR, "#grid-chart .main-svg")  # drawn
    for index, point in enumerate(grid.points):  # the first axis slowest
        slide(browser, "grid-axis-0", index // 2)
        slide(browser, "grid-axis-1", index % 2)
        assert text(browser, "step-time") == f"{point.estimate.time_s * 1e3:.3f} ms"
        assert text(browser, "grid-axis-1-value") == str(point.values["context"])
        price = "return window.torchroofPrice(arguments[0], 'l4', 1, 1)"
        on_l4 = browser.execute_script(price, index)
        fresh = torchroof.estimate(model, "decode", hardware="l4", **point.values)
        assert on_l4["step"] == fresh.time_s
    select(browser, "variant", "1")  # the picker moves the sliders back to its point
    assert browser.execute_script("return document.getElementById('grid-axis-1').value") == "1"
    assert browser.execute_script("return document.getElementById('grid-axis-0').value") == "0"
    assert errors(browser) == []


def test_a_one_axis_grid_page_draws_a_line_and_follows_its_slider(browser, tmp_path):
    from conftest import meta_causal_lm

    from torchroof.render.html import grid_html
    from torchroof.studies import sweep_grid

    model = meta_causal_lm("llama", **MID_LLAMA)
    grid = sweep_grid(model, {"batch": [1, 8, 64]}, regime="decode", context=256)
    path = tmp_path / "line.html"
    grid_html(grid, path)
    load(browser, path)
    slide(browser, "grid-axis-0", 2)
    assert text(browser, "step-time") == f"{grid.points[2].estimate.time_s * 1e3:.3f} ms"
    assert text(browser, "grid-axis-0-value") == "64"
    assert errors(browser) == []


def test_a_grid_page_crosses_the_points_that_do_not_fit(browser, tmp_path):
    """batch 16,384 x context 2,048 of the mid Llama holds 4 layers x 2 x 2 heads x 128 x 2
    bytes = 4 KiB of KV per token, 16,384 x 2,048 x 4 KiB = 128 GiB: past an H100's 80 GiB.
    Its cell is crossed and says so; batch 1 at 256 tokens fits and is not crossed."""
    from conftest import meta_causal_lm

    from torchroof.render.html import grid_html
    from torchroof.studies import sweep_grid

    model = meta_causal_lm("llama", **MID_LLAMA)
    grid = sweep_grid(model, {"batch": [1, 16384], "context": [256, 2048]}, regime="decode")
    assert not grid.points[3].estimate.memory.fits and grid.points[0].estimate.memory.fits
    path = tmp_path / "fit.html"
    grid_html(grid, path)
    load(browser, path)
    chart = "return document.getElementById('grid-chart').data"
    heat, crossed, _ = browser.execute_script(chart)  # the heat map, the crosses, the ring
    assert heat["text"][1][1] == " (does NOT fit)" and heat["text"][0][0] == ""
    assert (crossed["x"], crossed["y"]) == (["2048"], ["16384"])
    assert errors(browser) == []
