"""The stage Trace -> Estimate: price every op, group ops into kernels, time each on the
accelerator, schedule the streams, and collect the report's data (price.py); where the step
runs (hardware.py), collectives at the network boundary (collectives.py), routed experts on
the busiest rank (experts.py), bytes by what they hold (traffic.py), the assumptions stated
(assumptions.py) and the checks on a trace before it is priced (trace_checks.py).
"""
