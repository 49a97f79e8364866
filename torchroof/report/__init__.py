"""The estimate as data: timed kernels, their totals, the per-layer rows, the memory
footprint, what an estimate implies (analysis), a pipelined step's schedule (pipeline_step),
the words its string fields take (kinds) and variants side by side as data (compare; made by
torchroof.studies). Holds no renderer: text, files and pages are in torchroof.render.
"""
