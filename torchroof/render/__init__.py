"""The estimate for people: text tables and the summary (text, with summary_parts and units),
files (JSON, CSV; files.write picks the format by suffix), the Chrome trace, plots and the
self-contained HTML page (html, assets/), and a headless browser for its screenshot. The
public way to show an estimate: ``text.summary(est)``, ``text.layer_table(est)``,
``files.write(est, path)``, ``html.estimate_html(est, path)``.
"""
