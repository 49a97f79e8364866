"""Kernels from a trace: which ops a compiled runtime launches together (fusion, horizontal
fusion, column reductions), what a fused backward recomputes, and how the optimizer step
runs. Reads records and counters.
"""
