"""Parallel programs on one CPU: the plan (mesh sizes), torch.distributed's own strategies on
a fake process group (tensor, sequence, FSDP, context, expert), and pipeline parallelism
in pipeline/ (which traces and prices whole stages, so it sits above pricing).
"""
