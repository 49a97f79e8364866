"""Predicted versus measured: running a step for real and profiling it, calibrating a
device's ceilings, diagnosing a kernel slower than predicted, the Inductor referee for
the fused policy and its cases, and the model zoo.
"""
