"""Bad inputs answered: a data-dependent loop that never ends on meta is stopped
by the op budget with the module and the loop's ops named; positions past the model's
maximum and configs without layers are refused."""

import pytest
import torch

import torchroof
from torchroof.capture.budget import OpBudgetExceeded, op_budget
from torchroof.capture.mode import Capture
from torchroof.config.limits import DEFAULT_MAX_ITEM_ANSWERS, DEFAULT_MAX_OPS
from torchroof.models.sources import (
    LayerCountError,
    PositionLimitError,
    check_layers,
    check_positions,
    load_config,
    position_limit,
)


class _Halve(torch.nn.Module):
    """Halves x until it is small: on meta ``x.abs().max() > 1e-6`` is always True."""

    def forward(self, x):
        while x.abs().max() > 1e-6:
            x = x / 2
        return x


class _Solver(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, device="meta")
        self.solver = _Halve()

    def forward(self, x):
        return self.solver(self.proj(x))


def _x():
    return torch.ones(4, 4, device="meta")


# -- the op budget ------------------------------------------------------------------------
def test_runaway_loop_stops_at_the_op_budget_and_names_module_and_loop_body():
    with pytest.raises(OpBudgetExceeded) as caught:
        with torchroof.trace(max_ops=3000):
            _Solver()(_x())
    error = caught.value
    assert isinstance(error, RuntimeError)
    # stopped at the first op past the budget (not timed: the op count is the guarantee)
    assert error.ops == 3001 and error.module == "solver"
    message = str(error)
    first = message.splitlines()[0]
    assert "3,000 aten ops" in first and "max_ops=3,000" in first
    assert "module 'solver' (_Halve)" in first
    assert "data-dependent Python loop" in first
    # the loop body, from the most frequent ops of the last window
    loop_ops = {name for name, _ in error.frequent}
    assert {"aten.abs.default", "aten.max.default", "aten.gt.Scalar"} <= loop_ops
    assert {"aten.div.Tensor", "aten._local_scalar_dense.default"} <= loop_ops
    assert "aten.abs.default x" in message and "aten.div.Tensor x" in message
    assert "Tensor.item()" in message and "neutral" in message
    assert "torchroof.trace(max_ops=...)" in message


def test_ops_run_unrecorded_count_against_the_budget():
    capture = torchroof.trace(max_ops=2000, max_item_answers=10**9)
    with pytest.raises(OpBudgetExceeded, match="max_ops=2,000") as caught:
        with capture as t, capture.unrecorded():
            _Solver()(_x())
    assert t.ops == []  # nothing was recorded, and the loop was stopped all the same
    assert caught.value.module == "solver"


def test_item_answers_in_one_module_call_stop_the_loop_before_the_op_budget():
    with pytest.raises(OpBudgetExceeded) as caught:
        with torchroof.trace(max_item_answers=300):
            _Solver()(_x())
    error = caught.value
    first = str(error).splitlines()[0]
    assert "300 Tensor.item() answers in one module call" in first
    assert "module 'solver' (_Halve)" in first
    assert "max_item_answers=..." in str(error)
    assert error.ops < 300 * 10  # a handful of ops per iteration, far below max_ops


def test_the_default_budget_stops_the_loop_early_with_bounded_memory():
    """Under the defaults the item guard trips after 10,000 answers: ~60k ops recorded,
    not the millions (GBs) a runaway would reach before the 10M op budget."""
    capture = torchroof.trace()
    with pytest.raises(OpBudgetExceeded, match="max_item_answers=10,000") as caught:
        with capture as t:
            _Solver()(_x())
    assert caught.value.ops < 100_000 and len(t.ops) < 100_000
    assert caught.value.module == "solver"


class _CountingOptimizer(torch.optim.Optimizer):
    """Reads a meta step counter once per parameter, as Adafactor does."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("step", torch.zeros((), device="meta"))
                _ = float(self.state[p]["step"])
                p.add_(1.0)


def test_item_answers_inside_an_optimizer_step_do_not_count():
    params = [torch.nn.Parameter(torch.ones(2, device="meta")) for _ in range(50)]
    opt = _CountingOptimizer(params)
    with torchroof.trace(max_item_answers=10) as t:
        opt.step()
    assert sum("Tensor.item()" in a.what for a in t.assumptions) == 50


def test_a_loop_in_the_root_module_names_its_class():
    with pytest.raises(OpBudgetExceeded, match=r"stopped in the root module \(_Halve\)"):
        with torchroof.trace(max_ops=500):
            _Halve()(_x())


def test_budget_tripping_in_backward_keeps_its_type(tiny_llama):
    model = tiny_llama.train()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    forward_only = torchroof.trace()
    with forward_only:
        loss = model(ids, labels=ids).loss
    forward_ops = forward_only.op_count
    with pytest.raises(OpBudgetExceeded) as caught:
        with torchroof.trace(max_ops=forward_ops + 50):
            model(ids, labels=ids).loss.backward()
    assert caught.value.ops == forward_ops + 51
    assert "during backward" in str(caught.value).splitlines()[0]
    del loss


def test_a_real_training_step_fits_the_default_budget(tiny_llama):
    """Forward, loss, backward and a per-parameter (non-foreach) AdamW step under the
    default budget."""
    model = tiny_llama.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, foreach=False)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    capture = torchroof.trace()
    # the README's defaults: 10 M aten ops, 10,000 .item() answers in one module call
    assert capture.max_ops == DEFAULT_MAX_OPS == 10_000_000
    assert capture.max_item_answers == DEFAULT_MAX_ITEM_ANSWERS == 10_000
    with capture as t:
        model(ids, labels=ids).loss.backward()
        opt.step()
    assert {op.phase for op in t.ops} >= {"forward", "backward", "optimizer"}
    assert len(t.ops) <= capture.op_count < DEFAULT_MAX_OPS // 1000


def test_op_budget_sets_the_default_of_captures_made_inside():
    with op_budget(max_ops=1234):
        assert Capture().max_ops == 1234
        assert Capture().max_item_answers == DEFAULT_MAX_ITEM_ANSWERS
        assert Capture(max_ops=99).max_ops == 99
        with op_budget(max_item_answers=7):
            assert (Capture().max_ops, Capture().max_item_answers) == (1234, 7)
        with pytest.raises(OpBudgetExceeded, match="max_ops=1,234"):
            with Capture():
                _Solver()(_x())
    assert Capture().max_ops == DEFAULT_MAX_OPS


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_budget_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_ops must be a positive integer"):
        torchroof.trace(max_ops=bad)
    with pytest.raises(ValueError, match="max_item_answers must be a positive integer"):
        with op_budget(max_item_answers=bad):
            pass


# -- positions ----------------------------------------------------------------------------
def test_gpt2_at_4096_positions_is_refused_with_the_numbers():
    config = load_config("gpt2")
    with pytest.raises(PositionLimitError) as caught:
        check_positions(config, 4096, allow_beyond=False, name="gpt2")
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert message.startswith("gpt2: ")
    assert "4,096 positions" in message and "n_positions=1,024" in message
    assert "allow_beyond_max_positions=True" in message


def test_gpt2_beyond_its_positions_is_allowed_with_an_assumption():
    assumption = check_positions(load_config("gpt2"), 4096, allow_beyond=True, name="gpt2")
    assert assumption is not None
    assert "4,096 positions exceed gpt2's n_positions=1,024" in assumption
    assert "no position embedding" in assumption


def test_positions_up_to_the_maximum_pass():
    config = load_config("gpt2")
    assert position_limit(config) == ("n_positions", 1024)
    assert check_positions(config, 1024, allow_beyond=False) is None
    with pytest.raises(PositionLimitError, match="1,025 positions"):
        check_positions(config, 1024 + 1, allow_beyond=False)


def test_estimates_check_the_sequence_and_the_decode_cache(tmp_path):
    # prefill: seq against n_positions; decode: the cache's context (a 70B decode
    # at context 8192 = max_position_embeddings is the model's full window, allowed)
    with pytest.raises(PositionLimitError, match="1,025 positions"):
        torchroof.estimate("gpt2", "prefill", seq=1025)
    with pytest.raises(PositionLimitError, match="1,025 positions"):
        torchroof.estimate("gpt2", "decode", context=1025)
    # decode at context 1024 = n_positions: the cache is the model's full window, priced;
    # its new token sits at index 1024, which gpt2's position table has no row for: noted
    est = torchroof.estimate("gpt2", "decode", context=1024)
    assert [a for a in est.assumptions if a.startswith("positions:")] == [
        "positions: the step's new token sits at position 1,024, past gpt2's n_positions=1,024 "
        "(positions 0 to 1,023): a real run needs 1,025 positions; the model has no position "
        "embedding past that, so a real run fails there; priced as if the table were longer"
    ]
    within = torchroof.estimate("gpt2", "decode", context=1023)  # index 1023: the last row
    assert not any(a.startswith("positions:") for a in within.assumptions)
    beyond = torchroof.estimate("gpt2", "prefill", seq=1100, allow_beyond_max_positions=True)
    assert [a for a in beyond.assumptions if a.startswith("positions:")] == [
        "positions: " + check_positions(load_config("gpt2"), 1100, True, name="gpt2")
    ]


def test_llama_3_8b_at_100k_positions_is_refused():
    config = load_config("llama-3-8b")
    with pytest.raises(PositionLimitError, match=r"max_position_embeddings=8,192") as caught:
        check_positions(config, 100_000, allow_beyond=False, name="llama-3-8b")
    assert "llama-3-8b" in str(caught.value) and "100,000" in str(caught.value)
    allowed = check_positions(config, 100_000, allow_beyond=True, name="llama-3-8b")
    assert "rotary" in allowed
    # Llama 3.1 states 131,072 positions (RoPE scaled from 8,192)
    assert check_positions(load_config("llama-3.1-405b"), 100_000, allow_beyond=False) is None


def test_a_model_without_a_stated_maximum_is_not_checked():
    from transformers import AutoConfig

    config = AutoConfig.for_model("mamba", num_hidden_layers=2)
    assert position_limit(config) is None
    assert check_positions(config, 10**6, allow_beyond=False) is None


# -- layers -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model_type", "field", "value"),
    [
        ("llama", "num_hidden_layers", 0),
        ("llama", "num_hidden_layers", -2),
        ("gpt2", "n_layer", 0),
        ("t5", "num_layers", 0),
    ],
)
def test_a_config_without_layers_is_refused(model_type, field, value):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{field: value})
    with pytest.raises(LayerCountError, match=rf"{field}={value} in its config") as caught:
        check_layers(config, name="mine")
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith("mine: ")
    assert "at least 1 layer" in str(caught.value)


def test_every_shipped_config_has_layers():
    from torchroof.models.sources import shipped_models

    for name in shipped_models():
        check_layers(load_config(name))


def test_a_plain_module_is_told_how_to_trace_a_step_by_hand():
    import torch

    from torchroof.config import WorkloadError

    with pytest.raises(WorkloadError) as error:
        torchroof.estimate(torch.nn.Sequential(torch.nn.Linear(8, 8)), "train", seq=8)
    message = str(error.value)
    assert message.startswith("Sequential is not a transformers model: the train regime ")
    assert "with torchroof.trace() as t:" in message and "'A step traced by hand'" in message
