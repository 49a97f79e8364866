"""The stage Trace -> Estimate: price every op, group ops into kernels, time each on the
accelerator, schedule the streams, and collect the report's data.
"""
