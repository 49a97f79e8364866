"""The interactive HTML report and the README's screenshot of it: Llama-3-8B
training on an H100 SXM, written as one offline page, opened in headless chromium, then
switched to another accelerator in the page and checked against Python's estimate there.

    python examples/html_report.py                         # ~30 s on 2 cores
    python examples/html_report.py --switch h200-sxm --html /tmp/llama.html

Equivalent command: torchroof estimate --regime train --html llama-train.html
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torchroof
from torchroof.render import html
from torchroof.render.browser import console_errors, open_chromium

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--regime", default="train")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--switch", default="h200-sxm", help="accelerator to switch to")
    parser.add_argument("--html", default=None, help="where to write the page (default: tmp)")
    parser.add_argument("--screenshot", default=str(HERE / "html-report.png"))
    args = parser.parse_args()

    trace = torchroof.trace_model(args.model, regime=args.regime, precision="bf16")
    est = trace.estimate(args.hardware)
    page = Path(args.html or Path(tempfile.mkdtemp()) / "report.html")
    html.estimate_html(est, page)
    print(f"wrote {page} ({page.stat().st_size / 1e6:.1f} MB, {len(est.kernels)} kernels)")

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = open_chromium(width=1400, height=1900)
    try:
        driver.get(page.resolve().as_uri())
        step = driver.find_element(By.ID, "step-time").text
        print(f"page on {args.hardware}: {step} (Python {est.time_s * 1e3:.3f} ms)")
        driver.save_screenshot(args.screenshot)
        print(f"wrote {args.screenshot}")
        Select(driver.find_element(By.ID, "accelerator")).select_by_value(args.switch)
        switched = trace.estimate(args.switch)
        step = driver.find_element(By.ID, "step-time").text
        memory = driver.find_element(By.ID, "memory-fit").text
        print(f"page on {args.switch}: {step}, {memory} (Python {switched.time_s * 1e3:.3f} ms)")
        errors = console_errors(driver)
        print(f"console errors: {len(errors)}")
        for error in errors:
            print(f"  {error}")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
