"""The fake process group leaves the process as it found it: torch's
``init_process_group`` wraps ``sys.excepthook`` to prefix each line of an uncaught
traceback with ``[rank0]: ``, once more per group; the hook is restored on exit, so a
process that traced several parallel steps prints its tracebacks plainly."""

from __future__ import annotations

import sys

import torch.distributed as dist

from torchroof.parallel.program import fake_process_group


def test_each_fake_group_restores_the_excepthook():
    before = sys.excepthook
    for _ in range(3):
        with fake_process_group(2):
            assert dist.get_world_size() == 2
            assert sys.excepthook is not before  # torch's rank-prefixing wrapper
        assert sys.excepthook is before
    assert not dist.is_initialized()
