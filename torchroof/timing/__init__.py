"""Time on an accelerator: the roofline and realistic mode for one kernel, the hierarchical
roofline (bytes at every memory boundary), a kernel's problem shape, collectives on the
network, and the schedule of a step on its compute and communication streams.
"""
