"""The recorded facts of a traced step: tensors, ops, the trace that holds them, the step's
facts and the trace file format. It reads only torchroof.config (a step's facts hold the
Workload it ran).
"""
