"""Parallel programs on one CPU: torch.distributed's own strategies on a fake process group,
one module each (tensor, sequence, expert, fsdp, context; ``strategy`` says what one is,
``program`` lists them in torchtitan's order), the device mesh, the plans transformers
ships, and one pipeline stage of a model (``stages``, which the ordinary regimes run);
pipeline/ traces and prices whole pipelines (above pricing, though it lives here).
"""
