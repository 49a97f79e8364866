"""Quantisation recipes (torchao's, and packed low-bit weights and experts torchao cannot run
on meta) and quantised KV caches, applied to a model before it is traced.
"""
