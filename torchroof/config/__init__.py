"""Settings, defined once: what step to trace (Workload and its parts), how to price it
(PricingOptions), the CLI flags generated from both, the limits of a trace, and the
error types. A leaf: it imports nothing of torchroof.
"""
