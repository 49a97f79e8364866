"""Plans that run: the emitted torchtitan TOML, torchrun line and vLLM / SGLang commands,
with expectations derived by hand, every refusal in one line, and every key and flag checked
against the documented tables (and against torchtitan's own parser where it is installed)."""

from __future__ import annotations

import importlib.util
import shlex
import sys
import types
from pathlib import Path

import pytest

from torchroof.config.errors import OptionError
from torchroof.planning import documented
from torchroof.planning.emit import EMITTERS, emit_serving, emit_training
from torchroof.planning.layouts import ServingLayout, TrainingLayout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# fsdp 4 x dp 2 x tp 8 x pp 2 = 128 GPUs, 8 a node
BIG = TrainingLayout(fsdp=4, dp=2, tp=8, sequence_parallel=True, pp=2, batch=2, microbatches=8)
MODEL = {"model": "llama3", "flavor": "70B", "seq": 8192, "gpus_per_node": 8}


def job(layout: TrainingLayout, **options) -> dict:
    return tomllib.loads(emit_training("torchtitan", layout, **{**MODEL, **options}))


def flatten(table: dict, prefix: str = "") -> dict[str, dict]:
    """Sections by dotted name ("quantize.linear.float8"), each with its scalar keys."""
    out: dict[str, dict] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            scalars = {k: v for k, v in value.items() if not isinstance(v, dict)}
            if scalars:
                out[name] = scalars
            out.update(flatten(value, name + "."))
    return out


def check_schema(toml: dict) -> None:
    for section, keys in flatten(toml).items():
        assert section in documented.TORCHTITAN_KEYS, section
        for key, value in keys.items():
            assert key in documented.TORCHTITAN_KEYS[section], f"{section}.{key}"
            assert type(value) is documented.TORCHTITAN_KEYS[section][key], f"{section}.{key}"
            choices = documented.TORCHTITAN_CHOICES.get(f"{section}.{key}")
            if choices is not None:
                assert set(value if isinstance(value, list) else [value]) <= set(choices)


def test_the_big_layout_maps_one_to_one():
    toml = job(BIG)
    par = toml["parallelism"]
    assert par["data_parallel_shard_degree"] == 4
    assert par["data_parallel_replicate_degree"] == 2
    assert par["tensor_parallel_degree"] == 8
    assert par["pipeline_parallel_degree"] == 2
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == 2  # the layout's batch
    # a pipelined data rank holds batch x microbatches = 2 x 8 = 16 sequences;
    # global = 2 x 8 x fsdp 4 x dp 2 = 128
    assert toml["training"]["local_batch_size"] == 16
    assert toml["training"]["global_batch_size"] == 128 == BIG.global_batch
    assert toml["model"] == {"name": "llama3", "flavor": "70B"}
    assert toml["activation_checkpoint"] == {"mode": "none"}
    check_schema(toml)


def test_without_a_pipeline_micro_batches_are_gradient_accumulation():
    toml = job(TrainingLayout(fsdp=8, batch=2, microbatches=4))
    # local 2; global 2 x 4 x 8 = 64, so torchtitan accumulates 64 / (2 x 8) = 4 steps
    assert toml["training"]["local_batch_size"] == 2
    assert toml["training"]["global_batch_size"] == 64
    assert "pipeline_parallel_schedule" not in toml["parallelism"]


def test_options_recompute_compile_float8_async_tp():
    layout = TrainingLayout(fsdp=8, tp=2, sequence_parallel=True, recompute="selective")
    toml = job(layout, quant="fp8-rowwise", compile=True, async_tp=True, hf_assets_path="./a")
    assert toml["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert toml["compile"]["enable"] is True
    assert toml["model"]["converters"] == ["quantize.linear.float8"]
    assert toml["model"]["hf_assets_path"] == "./a"
    assert toml["quantize"]["linear"]["float8"]["recipe_name"] == "rowwise"
    assert toml["parallelism"]["enable_async_tensor_parallel"] is True
    assert job(TrainingLayout(recompute="full"))["activation_checkpoint"] == {"mode": "full"}
    assert job(TrainingLayout(fsdp=2), quant="fp8")["quantize"]["linear"]["float8"] == {
        "recipe_name": "tensorwise"
    }
    check_schema(toml)


@pytest.mark.parametrize("schedule", sorted(documented.PIPELINE_SCHEDULE_CLASSES))
def test_every_schedule_is_a_torch_pipelining_class(schedule):
    from torch.distributed.pipelining.schedules import get_schedule_class

    layout = TrainingLayout(pp=4, pp_schedule=schedule, batch=1, microbatches=8)
    name = job(layout)["parallelism"]["pipeline_parallel_schedule"]
    assert get_schedule_class(name).__name__ == "Schedule" + name


def test_interleaved_past_two_stages_a_rank_sets_layers_per_stage():
    layout = TrainingLayout(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=4, microbatches=16)
    # 4 x 4 = 16 stages over 30 layers + 2 (embedding, head): ceil(32 / 16) = 2 a stage
    toml = job(layout, num_layers=30)
    assert toml["parallelism"]["pipeline_parallel_layers_per_stage"] == 2
    assert "layers_per_stage" not in str(job(TrainingLayout(pp=4, pp_schedule="zbv")))


def test_tp_without_sequence_parallel_is_emitted_with_a_note():
    text = emit_training("torchtitan", TrainingLayout(tp=8), **MODEL)
    assert "NB: torchtitan applies sequence parallel" in text


def test_torchrun_on_sixteen_nodes():
    text = emit_training("torchrun", BIG, **MODEL)
    (line,) = [line for line in text.splitlines() if line.startswith("torchrun")]
    args = shlex.split(line)
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args[1:])  # torch's own torchrun parser
    assert (parsed.nnodes, parsed.nproc_per_node) == ("16", "8")  # 128 / 8 nodes
    assert parsed.rdzv_endpoint == "$HEAD_NODE_ADDR:29500"
    assert parsed.module and parsed.training_script == "torchtitan.train"
    assert parsed.training_script_args == ["--job.config_file", "job.toml"]
    one = emit_training("torchrun", TrainingLayout(fsdp=4), **MODEL)
    assert "--nnodes 1 --nproc_per_node 4 --standalone" in one


REFUSALS = [
    (lambda: emit_training("megatron", BIG, **MODEL), "unknown emitter 'megatron'"),
    (lambda: emit_training("vllm", BIG, **MODEL), "takes a ServingLayout"),
    (lambda: emit_serving("torchtitan", ServingLayout(), model="m"), "takes a TrainingLayout"),
    (lambda: emit_serving("sglang", BIG, model="m"), "takes a ServingLayout"),
    (lambda: job(TrainingLayout(dp=8, zero=2)), "ZeRO-2 over plain DDP"),
    (lambda: job(TrainingLayout(dp=8, zero=1)), "ZeRO-1"),
    (lambda: job(TrainingLayout(fsdp=2, ep=4)), "ep 4 does not divide"),
    (lambda: job(TrainingLayout(fsdp=2), dtype="fp16"), "dtype='fp16'"),
    (lambda: job(TrainingLayout(fsdp=2), quant="int4-weight"), "quant='int4-weight'"),
    (lambda: job(TrainingLayout(fsdp=2), async_tp=True), "needs tp > 1"),
    (
        lambda: job(TrainingLayout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3)),
        "num_layers=",
    ),
    (
        lambda: emit_training("torchrun", TrainingLayout(fsdp=12), **MODEL),
        "do not fill whole nodes",
    ),
    (lambda: serve("vllm", kv_dtype="int8"), "kv_dtype 'int8' has no vLLM flag"),
    (lambda: serve("sglang", kv_dtype="int8"), "kv_dtype 'int8' has no SGLang flag"),
    (lambda: serve("vllm", quant="int4-weight"), "quant recipe 'int4-weight' has no vLLM"),
    (lambda: serve("sglang", quant="fp8-rowwise"), "'fp8-rowwise' has no SGLang"),
    (lambda: serve("vllm", tp=4, ep=2), "vLLM's expert parallel spans"),
    (lambda: serve("sglang", tp=4, ep=3), "divides tp 4"),
]


def serve(target: str, **knobs) -> str:
    return emit_serving(target, ServingLayout(**knobs), model="meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize("call, words", REFUSALS)
def test_every_refusal_is_one_line(call, words):
    with pytest.raises(OptionError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and words in message, message


def test_an_unknown_emitter_lists_the_known_ones():
    with pytest.raises(OptionError, match=", ".join(EMITTERS)):
        emit_serving("tgi", ServingLayout(), model="m")


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if line and line[0] != "#"]


def check_flags(args: list[str], flags: dict, choices: dict) -> dict[str, str | None]:
    """Every ``--flag`` is documented; a valued flag's value parses and is a choice."""
    seen: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in flags, flag
        kind = flags[flag]
        value = None if kind is None else args[i + 1]
        if kind is int:
            int(value)
        if flag in choices:
            assert value in choices[flag], (flag, value)
        seen[flag] = value
        i += 1 if kind is None else 2
    return seen


def test_vllm_command_flags_and_values():
    layout = ServingLayout(tp=8, pp=2, replicas=2, ep=16, kv_dtype="fp8", quant="fp8-rowwise")
    (args,) = commands(emit_serving("vllm", layout, model="org/M", max_model_len=32768))
    assert args[:3] == ["vllm", "serve", "org/M"]
    seen = check_flags(args[3:], documented.VLLM_FLAGS, documented.VLLM_CHOICES)
    assert seen["--tensor-parallel-size"] == "8" and seen["--pipeline-parallel-size"] == "2"
    assert seen["--data-parallel-size"] == "2" and "--enable-expert-parallel" in seen
    assert seen["--kv-cache-dtype"] == "fp8_e4m3"
    assert seen["--quantization"] == "fp8_per_channel"
    assert seen["--max-num-seqs"] == "256" and seen["--max-num-batched-tokens"] == "8192"
    assert "--enable-chunked-prefill" in seen and seen["--max-model-len"] == "32768"
    (off,) = commands(serve("vllm", chunked_prefill=False))
    assert "--no-enable-chunked-prefill" in off and "--kv-cache-dtype" not in off


def test_sglang_command_flags_and_values():
    layout = ServingLayout(tp=8, replicas=4, ep=8, kv_dtype="fp8", quant="fp8")
    (args,) = commands(emit_serving("sglang", layout, model="org/M", max_model_len=4096))
    assert args[:3] == ["python", "-m", "sglang.launch_server"]
    seen = check_flags(args[3:], documented.SGLANG_FLAGS, documented.SGLANG_CHOICES)
    assert seen["--model-path"] == "org/M" and seen["--tp-size"] == "8"
    assert seen["--dp-size"] == "4" and seen["--ep-size"] == "8"
    assert seen["--max-running-requests"] == "256" and seen["--chunked-prefill-size"] == "8192"
    assert seen["--kv-cache-dtype"] == "fp8_e4m3" and seen["--quantization"] == "fp8"
    assert seen["--context-length"] == "4096"
    (off,) = commands(serve("sglang", chunked_prefill=False, max_num_batched_tokens=4096))
    assert off[off.index("--chunked-prefill-size") + 1] == "-1"
    assert off[off.index("--max-prefill-tokens") + 1] == "4096"


def test_data_parallel_attention_is_one_engine_of_every_rank():
    # tp 1 x dp 8, the experts over all 8 GPUs: vLLM's --data-parallel-size with expert
    # parallel, its batch knobs per rank; SGLang's one server of tp_size 8 with DP
    # attention (attention's tp 8/8 = 1), whose batch knobs it divides by dp 8: 8 x 64
    # running requests and 8 x 2048 tokens a chunk give each rank 64 and 2048
    layout = ServingLayout(
        tp=1, replicas=8, ep=8, quant="fp8", max_num_seqs=64, max_num_batched_tokens=2048
    )
    assert (layout.attention_dp, layout.gpus) == (8, 8)
    (args,) = commands(emit_serving("vllm", layout, model="deepseek-ai/DeepSeek-V3"))
    seen = check_flags(args[3:], documented.VLLM_FLAGS, documented.VLLM_CHOICES)
    assert seen["--tensor-parallel-size"] == "1" and seen["--data-parallel-size"] == "8"
    assert "--enable-expert-parallel" in seen
    assert seen["--max-num-seqs"] == "64" and seen["--max-num-batched-tokens"] == "2048"
    (args,) = commands(emit_serving("sglang", layout, model="deepseek-ai/DeepSeek-V3"))
    seen = check_flags(args[3:], documented.SGLANG_FLAGS, documented.SGLANG_CHOICES)
    assert seen["--tp-size"] == "8" and seen["--dp-size"] == "8" and seen["--ep-size"] == "8"
    assert "--enable-dp-attention" in seen and "--enable-dp-lm-head" in seen
    assert seen["--moe-dense-tp-size"] == "1"
    assert seen["--max-running-requests"] == "512" and seen["--chunked-prefill-size"] == "16384"
    # independent replicas of a MoE engine (ep = tp) are not a data-parallel group
    assert ServingLayout(tp=2, replicas=4, ep=2).attention_dp == 1


def test_disaggregated_layouts_give_one_command_per_role():
    layout = ServingLayout(disaggregate="2P1D", prefill_tp=4, decode_tp=8)
    prefill, decode = commands(emit_serving("vllm", layout, model="m"))
    for args, tp in ((prefill, "4"), (decode, "8")):
        seen = check_flags(args[3:], documented.VLLM_FLAGS, documented.VLLM_CHOICES)
        assert seen["--tensor-parallel-size"] == tp
        assert seen["--kv-transfer-config"] == (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
        )
    prefill, decode = commands(emit_serving("sglang", layout, model="m"))
    for args, role, tp in ((prefill, "prefill", "4"), (decode, "decode", "8")):
        seen = check_flags(args[3:], documented.SGLANG_FLAGS, documented.SGLANG_CHOICES)
        assert seen["--disaggregation-mode"] == role and seen["--tp-size"] == tp
        assert "--dp-size" not in seen


@pytest.fixture
def torchtitan_config_manager():
    """torchtitan 0.2.x's ConfigManager, loaded without the package ``__init__`` (it imports
    the MoE kernels, which need triton and a GPU); skipped where torchtitan is not
    installed. torchtitan's modules leave ``sys.modules`` afterwards."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("torchtitan 0.2.x is not installed (pip install --no-deps torchtitan==0.2.2)")

    def ours(name: str) -> bool:
        return name == "torchtitan" or name.startswith("torchtitan.")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    package = types.ModuleType("torchtitan")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchtitan"] = package
    try:
        from torchtitan.config import ConfigManager

        yield ConfigManager
    except ImportError as error:
        pytest.skip(f"torchtitan.config does not import here: {error}")
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize(
    "layout, options",
    [
        (BIG, {"quant": "fp8", "compile": True}),
        (TrainingLayout(fsdp=8, tp=4, sequence_parallel=True, cp=2, recompute="selective"), {}),
        (
            TrainingLayout(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=4),
            {"num_layers": 30},
        ),
    ],
)
def test_torchtitans_own_parser_reads_the_job(
    layout, options, tmp_path: Path, torchtitan_config_manager
):
    path = tmp_path / "job.toml"
    path.write_text(emit_training("torchtitan", layout, **MODEL, **options))
    config = torchtitan_config_manager().parse_args(["--job.config_file", str(path)])
    toml = tomllib.loads(path.read_text())
    for section, keys in flatten(toml).items():
        target = config
        for part in section.split("."):
            target = getattr(target, part)
        for key, value in keys.items():
            assert getattr(target, key) == value, f"{section}.{key}"


def test_torchtitans_parser_refuses_a_key_it_does_not_know(
    tmp_path: Path, torchtitan_config_manager
):
    # the check above means something only if torchtitan rejects what it does not define
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\nno_such_degree = 2\n")
    with pytest.raises(Exception):  # noqa: B017 (torchtitan's own error type)
        torchtitan_config_manager().parse_args(["--job.config_file", str(path)])
