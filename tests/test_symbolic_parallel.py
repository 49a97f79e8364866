"""Steps across GPUs traced once with their sizes as symbols: a tensor-parallel decode on a
fake process group (torchroof/workloads/parallel_step.py) is traced on symbols, each point
made from it is the trace a fresh trace records, op for op, and its kernels are planned once
for every size and laid on the streams at each point (torchroof/pricing/planned_streams.py),
equal to a fresh estimate; the fake tensor mode takes eager's paths
(torchroof/capture/eager_fake.py); a step that still cannot be traced on symbols says why."""

from dataclasses import replace

import pytest
import torch
from conftest import small_llama
from hypothesis import given, settings
from hypothesis import strategies as st

import torchroof
from torchroof.api import trace_workload
from torchroof.capture.eager_fake import EagerViewsFakeMode, eager_view_strides
from torchroof.config import Workload
from torchroof.report.compare import point_metrics
from torchroof.symbolic import symbolic_axes, symbolic_point, trace_symbolic

CONFIG = small_llama(2)
DECODE = Workload(regime="decode", batch=3, context=16, tp=2)


def test_a_tensor_parallel_step_follows_its_sizes_but_not_pipelines_or_context_parallel():
    assert symbolic_axes(DECODE) == ("batch", "context")
    assert symbolic_axes(replace(DECODE, regime="prefill", seq=16)) == ("batch", "seq")
    assert "pipeline stages" in symbolic_axes(replace(DECODE, pp=2))
    ring = replace(DECODE, regime="prefill", cp=2, seq=16, cache="dynamic")
    assert "context-parallel" in symbolic_axes(ring)


def test_a_point_of_a_tensor_parallel_decode_is_the_trace_a_fresh_trace_records():
    """The all-reduce's result handed on as eager hands it on (``_wrap_tensor_autograd``, not
    the ``wait_tensor`` torch uses when compiling), and o_proj's row-parallel matmul folded
    into one ``mm`` as in eager (its input's strides are eager's)."""
    symbolic = trace_symbolic(CONFIG, DECODE)
    names = [op.name for op in symbolic.trace.ops]
    assert "_c10d_functional.wait_tensor.default" not in names
    assert "_c10d_functional._wrap_tensor_autograd.default" in names
    o_proj = [op.name for op in symbolic.trace.ops if op.module.endswith("self_attn.o_proj")]
    assert "aten.mm.default" in o_proj and "aten.bmm.default" not in o_proj
    for batch, context in ((5, 16), (2, 40), (9, 7)):
        point = replace(DECODE, batch=batch, context=context)
        made = symbolic_point(symbolic, CONFIG, point)
        assert made is not None
        fresh = trace_workload(CONFIG, point)
        assert made == fresh and made.facts == fresh.facts


def test_tensor_parallel_decode_prices_each_batch_from_one_plan_as_estimate_does():
    """Every batch of a prepared tensor-parallel decode from two symbolic traces (a batch of 1,
    and the rest) and kernels planned once, laid on the streams at each point: the step time
    within 1e-9 of a fresh estimate's, every kernel counted, the figures equal."""
    prepared = torchroof.prepare(CONFIG, "decode", context=16, tp=2)
    for batch, context in ((1, 16), (2, 16), (3, 16), (5, 16), (8, 16), (4, 50)):
        times = prepared.kernel_times("dgx-h100", batch=batch, context=context)
        fresh = torchroof.estimate(
            CONFIG, "decode", hardware="dgx-h100", batch=batch, context=context, tp=2
        )
        assert times.time_s == pytest.approx(fresh.time_s, rel=1e-9)
        assert sum(times.counts) == len(fresh.kernels)
        figures = prepared.metrics("dgx-h100", batch=batch, context=context)
        assert figures == point_metrics(fresh)
        assert figures["exposed_communication_s"] > 0  # the all-reduces, laid on the streams
    info = prepared.cache_info()
    assert prepared.notes == []  # nothing traced or priced the long way
    assert (info.symbolic, info.traced, info.planned) == (2, 0, 12)
    # without overlap each collective waits for the kernel before it: the plain sum
    serial = prepared.kernel_times("dgx-h100", batch=6, overlap_communication=False)
    fresh = torchroof.estimate(
        CONFIG, "decode", hardware="dgx-h100", batch=6, context=16, tp=2,
        overlap_communication=False,
    )  # fmt: skip
    assert serial.time_s == pytest.approx(fresh.time_s, rel=1e-9)


def test_a_point_traced_as_it_is_is_priced_from_its_own_trace():
    """A batch of 1 already traced (a step timer reads the prepared step's trace first) is
    priced from that trace, equal to a fresh estimate, with no symbolic trace made for it
    (one would hold at a batch of 1 alone); the next batch makes the one for the rest."""
    prepared = torchroof.prepare(CONFIG, "decode", context=16, tp=2)
    prepared.trace(batch=1)
    times = prepared.kernel_times("dgx-h100", batch=1)
    fresh = torchroof.estimate(CONFIG, "decode", hardware="dgx-h100", batch=1, context=16, tp=2)
    assert times.time_s == fresh.time_s and sum(times.counts) == len(fresh.kernels)
    info = prepared.cache_info()
    assert (info.symbolic, info.traced, info.planned) == (0, 1, 0)
    prepared.kernel_times("dgx-h100", batch=3)
    info = prepared.cache_info()
    assert (info.symbolic, info.traced, info.planned) == (1, 1, 1)


def test_a_sequence_parallel_prefill_is_traced_at_each_size_and_says_why():
    """DTensor narrows the gathered sequence shards by a size it cannot tell is zero on
    symbols, which eager does not: the trace at a second point differs from a fresh one, so
    each point is traced and priced as it is, equal to a fresh estimate, and the notes say
    why."""
    config = small_llama(1)
    prepared = torchroof.prepare(config, "prefill", seq=16, tp=2, sequence_parallel=True)
    times = prepared.kernel_times("dgx-h100", batch=2, seq=32)
    fresh = torchroof.estimate(
        config, "prefill", hardware="dgx-h100", batch=2, seq=32, tp=2, sequence_parallel=True
    )
    assert times.time_s == fresh.time_s
    assert prepared.notes == [
        "batch=2, seq=32: traced at each size (the trace at {'batch': 4, 'seq': 34} differs "
        "from tracing it afresh)"
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
    st.randoms(use_true_random=False),
)
def test_a_view_s_strides_are_eager_s(sizes, rng):
    """:func:`eager_view_strides` gives every view the strides torch's C++ kernel gives it
    (a size-1 dimension's too), and refuses what it refuses."""
    order = list(range(len(sizes)))
    rng.shuffle(order)
    tensor = torch.empty(*sizes, device="meta").permute(*order)
    numel = tensor.numel()
    shape = [d for d in (1, 2, 3, 1) if numel % d == 0 and rng.random() < 0.5]
    rest = numel
    for d in shape:
        rest //= d
    shape.insert(rng.randrange(len(shape) + 1), rest)
    try:
        eager = tuple(tensor.view(shape).stride())
    except RuntimeError:
        eager = None
    assert eager_view_strides(tensor.shape, tensor.stride(), shape) == eager


def test_the_fake_mode_views_as_eager_does():
    """Attention's output ``(b, 1, heads, d)`` reshaped to ``(b, 1, heads·d)``: the plain fake
    mode gives the size-1 dimension the stride of a head, eager and this mode a token's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def viewed() -> tuple[int, ...]:
        out = torch.empty(3, 2, 1, 32).transpose(1, 2)
        return tuple(out.reshape(3, 1, -1).stride())

    with FakeTensorMode():
        assert viewed() == (64, 32, 1)
    with EagerViewsFakeMode():
        assert viewed() == (64, 64, 1)
    meta = torch.empty(3, 2, 1, 32, device="meta").transpose(1, 2)
    assert tuple(meta.reshape(3, 1, -1).stride()) == (64, 64, 1)


def test_repeated_layers_expose_communication_as_a_fresh_estimate_adds_it():
    """With 7 layers alike the planned kernels run several times each: every launch's own
    exposed time is added in launch order, as a fresh estimate adds them, so the figures
    are equal to the last bit (the mean per kernel times its count was 1 ulp off)."""
    config = small_llama(7)
    prepared = torchroof.prepare(config, "decode", context=16, tp=2)
    for batch in (2, 3):
        fresh = torchroof.estimate(
            config, "decode", hardware="dgx-h100", batch=batch, context=16, tp=2
        )
        assert max(prepared.kernel_times("dgx-h100", batch=batch).counts) > 1
        assert prepared.metrics("dgx-h100", batch=batch) == point_metrics(fresh)


def test_what_still_traces_at_each_size_and_a_step_with_no_cluster():
    from torchroof.pricing.collectives import ClusterRequiredError

    assert "expert-parallel" in symbolic_axes(replace(DECODE, tp=1, dp=2, ep=2))
    # on one H100 (no cluster) the planned step gives the fresh estimate's refusal: 2
    # all-reduces a layer for 8 layers, one for the embedding, one gather of the logits
    prepared = torchroof.prepare(small_llama(8), "decode", context=16, tp=2)
    with pytest.raises(ClusterRequiredError, match="this step has 18 collectives"):
        prepared.kernel_times("h100-sxm", batch=3)


def test_an_empty_view_has_eager_s_strides():
    # computeStride keeps an empty tensor's strides where the shape stays, and otherwise
    # gives it contiguous strides with each size counted at least 1
    assert eager_view_strides((2, 0), (1, 2), (2, 0)) == (1, 2)
    assert eager_view_strides((2, 0, 3), (1, 6, 2), (2, 0, 3)) == (1, 6, 2)
    assert eager_view_strides((2, 0), (1, 2), (0, 4)) == (4, 1)  # max(4, 1) x 1
    base = torch.empty(16, device="meta").as_strided([2, 0], [1, 2])
    assert tuple(base.view(0, 4).stride()) == (4, 1)


def test_weights_are_sharded_on_meta_and_their_shards_adopted(monkeypatch):
    """The tensor-parallel plan shards the meta weights with the fake tensor mode off (a
    shard has no symbolic size), and the capture then adopts each shard, so the trace reads
    the shards under their own names: the same trace a fresh one records."""
    from torchroof.capture import symbolic as capture
    from torchroof.parallel import tensor

    modes = []
    shard = tensor.apply_tensor_parallel

    def recorded(model, mesh, plan=None):
        modes.append(capture.fake_mode_on())
        return shard(model, mesh, plan)

    monkeypatch.setattr(tensor, "apply_tensor_parallel", recorded)
    # made and checked against a fresh trace at a second point (the shards not adopted,
    # the weights it reads would be new storages, and that check refuses the trace)
    symbolic = trace_symbolic(CONFIG, DECODE)
    # the symbolic trace sharded with the fake mode off, as the fresh one (never under it)
    assert modes == [False, False]
    names = symbolic.trace.parameters  # storage id -> the weight's name
    q = next(
        t
        for op in symbolic.trace.ops
        for t in op.inputs
        if names.get(t.storage) == "model.layers.0.self_attn.q_proj.weight"
    )
    # rank 0's half of q_proj (4 heads of 32 over tp 2: 64 of 128 rows), read by its name
    assert tuple(q.shape) == (64, 128)
