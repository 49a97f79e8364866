"""Pipeline parallelism: torch's own schedules laid on a per-rank timeline, one trace per
distinct stage (``trace``; the stages themselves are :mod:`torchroof.parallel.stages`),
stage traces shared between steps that run the same stage programs (``shared``), and the
pipelined step priced from them. It sits above pricing (it prices each stage) though it
lives under parallel/.
"""
