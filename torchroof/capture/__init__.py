"""The dispatch mode that records every aten op of a step on meta, and its collaborators:
the module stack, the phases, storage identity, the op writer, SDPA substitution, answers for
data-dependent ops (routing, .item()) and the op budget. Imports config, records and
progress only.
"""
