"""The estimate for people: text tables, files (JSON, CSV), the Chrome trace, plots and the
self-contained HTML page (assets/), and a headless browser for its screenshot.
"""
