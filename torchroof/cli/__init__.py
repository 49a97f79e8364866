"""The ``torchroof`` command: one module per command, a thin layer over the Python API that
prints its objects.
"""
