"""The estimate as data: timed kernels, their totals, the per-layer rows, the memory
footprint, what an estimate implies (analysis) and variants side by side. Holds no
renderer: text, files and pages are in torchroof.render.
"""
