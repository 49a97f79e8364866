"""The dispatch mode that records every aten op of a step on meta, and its collaborators:
the module stack, storage identity, answers for data-dependent ops (routing, .item()),
the op budget. Imports config and records only.
"""
