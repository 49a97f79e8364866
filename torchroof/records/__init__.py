"""The recorded facts of a traced step: tensors, ops, the trace that holds them, the step's
facts and the trace file format. A leaf: it imports nothing of torchroof.
"""
