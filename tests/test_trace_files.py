"""Saved traces checked on load: a format version and an op count written at save
time, every field and op checked, every problem in one ``TraceFileError`` naming the file,
and ``torchroof estimate --from-trace BAD.json`` answered in one line with exit code 2."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import meta_causal_lm

import torchroof
from torchroof import Trace
from torchroof.cli.main import main
from torchroof.records.trace_file import TRACE_FORMAT_VERSION, TraceFileError
from torchroof.render.files import estimate_json

STRING_SHAPE = re.compile(
    r"ops\[(?P<pos>\d+)\] \((?P<name>[^)]+)\) (?P<side>in|out)\[(?P<n>\d+)\]: "
    r"shape (?P<shape>\S+) is not a list of non-negative integers"
)
COUNT = re.compile(r"(?P<found>\d+) ops found, (?P<recorded>\d+) recorded at save time")


@pytest.fixture(scope="module")
def train_step() -> Trace:
    """A tiny Llama's steady-state training step traced by hand: forward, loss, backward and
    AdamW, so the file holds every phase but recompute, roles and parameters."""
    model = meta_causal_lm("llama", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    for _ in range(2):  # the second step's state already exists
        opt.zero_grad()
        with torchroof.trace() as t:
            model(ids, labels=ids).loss.backward()
            opt.step()
    return t


@pytest.fixture(scope="module")
def saved(train_step, tmp_path_factory) -> dict:
    """The saved file's JSON, as ``Trace.save`` wrote it."""
    path = tmp_path_factory.mktemp("saved") / "step.json"
    train_step.save(path)
    return json.loads(path.read_text())


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _write(tmp_path: Path, data: object, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _parse(message: str, path: Path | None) -> tuple[int, list[str], int]:
    """(problems in all, problems listed, problems not listed) of a TraceFileError message."""
    where = "trace" if path is None else f"trace {path}"
    assert message.startswith(f"{where}: "), message
    body = message[len(where) + 2 :]
    many = re.match(r"(\d+) problems: (.*)", body)
    if many is None:
        return 1, [body], 0
    total, listed = int(many[1]), many[2].split("; ")
    rest = re.fullmatch(r"and (\d+) more", listed[-1])
    if rest:
        listed = listed[:-1]
    left = int(rest[1]) if rest else 0
    # the README: a refused file names "its first five problems, with a count of the rest"
    assert total == len(listed) + left and len(listed) == min(total, 5)
    return total, listed, left


def _refused(path: Path, capsys) -> tuple[int, list[str], int]:
    """Run ``estimate --from-trace path``: exit 2, nothing on stdout, one stderr line."""
    assert main(["estimate", "--from-trace", str(path), "--kernels", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    prefix = "torchroof: error: "
    assert lines[0].startswith(prefix)
    return _parse(lines[0][len(prefix) :], path)


def _load_problems(data: object) -> list[str]:
    with pytest.raises(TraceFileError) as caught:
        Trace.from_dict(data)
    return caught.value.problems


# -- the CLI: one line, exit 2 -------------------------------------------------------------


def test_cli_malformed_json(tmp_path, capsys):
    text = '{"format": "torchroof-trace", "version": 2,, "ops": []}'
    total, (problem,), _ = _refused(_write(tmp_path, text), capsys)
    assert total == 1
    found = re.fullmatch(r"not valid JSON: (.+): line 1 column (\d+) \(char (\d+)\)", problem)
    assert found, problem
    assert text[int(found[3])] == "," and text[int(found[3]) - 1] == ","  # the second comma
    assert int(found[2]) == int(found[3]) + 1


def test_cli_truncated_file_is_malformed_json(saved, tmp_path, capsys):
    text = json.dumps(saved)
    total, (problem,), _ = _refused(_write(tmp_path, text[: len(text) // 2]), capsys)
    assert total == 1 and problem.startswith("not valid JSON: ")


def test_cli_top_level_list(saved, tmp_path, capsys):
    assert _refused(_write(tmp_path, [saved]), capsys) == (
        1,
        ["not a torchroof trace: the top level is a list, not an object"],
        0,
    )


def test_cli_missing_ops(saved, tmp_path, capsys):
    data = dict(saved)
    del data["ops"]
    assert _refused(_write(tmp_path, data), capsys) == (1, ['missing "ops"'], 0)


def test_cli_string_shapes_lists_first_problems_and_counts_the_rest(saved, tmp_path, capsys):
    data = copy.deepcopy(saved)
    spoiled = []  # (position, name, side, n, shape as written) of every tensor made wrong
    for position, op in enumerate(data["ops"][:4]):
        for side in ("in", "out"):
            for n, tensor in enumerate(op[side]):
                tensor[0] = [str(size) for size in tensor[0]]
                spoiled.append((position, op["op"], side, n, tensor[0]))
    assert len(spoiled) > 5
    total, listed, left = _refused(_write(tmp_path, data), capsys)
    assert total == len(spoiled) and left == len(spoiled) - 5  # five listed
    for problem, (position, name, side, n, shape) in zip(listed, spoiled, strict=False):
        found = STRING_SHAPE.fullmatch(problem)
        assert found, problem
        assert (int(found["pos"]), found["name"], found["side"], int(found["n"])) == (
            position,
            name,
            side,
            n,
        )
        assert json.loads(found["shape"]) == shape
    with pytest.raises(TraceFileError) as caught:
        Trace.load(tmp_path / "bad.json")
    assert len(caught.value.problems) == len(spoiled)  # the exception keeps them all


def test_cli_truncated_op_list(saved, tmp_path, capsys):
    data = dict(saved, ops=saved["ops"][: len(saved["ops"]) // 2])
    total, (problem,), _ = _refused(_write(tmp_path, data), capsys)
    found = COUNT.fullmatch(problem)
    assert found, problem
    assert int(found["found"]) == len(saved["ops"]) // 2
    assert int(found["recorded"]) == saved["op_count"] == len(saved["ops"])


def test_cli_added_op_is_refused(saved, tmp_path, capsys):
    extra = dict(saved["ops"][-1], i=saved["ops"][-1]["i"] + 1)
    data = dict(saved, ops=[*saved["ops"], extra])
    total, (problem,), _ = _refused(_write(tmp_path, data), capsys)
    found = COUNT.fullmatch(problem)
    assert found and (int(found["found"]), int(found["recorded"])) == (
        len(saved["ops"]) + 1,
        len(saved["ops"]),
    )


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_cli_unreadable_file(tmp_path, capsys, kind):
    path = tmp_path / "trace.json"
    if kind == "directory":
        path.mkdir()
    total, (problem,), _ = _refused(path, capsys)
    expected = "No such file or directory" if kind == "missing" else "Is a directory"
    assert total == 1 and problem == f"cannot read it: {expected}"


# -- format version ------------------------------------------------------------------------


def test_saved_file_records_version_and_op_count(train_step, saved):
    assert saved["format"] == "torchroof-trace"
    assert saved["version"] == TRACE_FORMAT_VERSION == 3
    assert saved["op_count"] == len(saved["ops"]) == len(train_step)


def test_newer_version_is_refused_with_upgrade_hint(saved, tmp_path, capsys):
    data = dict(saved, version=TRACE_FORMAT_VERSION + 1)
    total, (problem,), _ = _refused(_write(tmp_path, data), capsys)
    assert problem == (
        f"format version {TRACE_FORMAT_VERSION + 1} is newer than this torchroof reads "
        f"(1-{TRACE_FORMAT_VERSION}); upgrade torchroof, or re-save the trace with this one"
    )


@pytest.mark.parametrize("version", [0, -1, "2", 2.0, True, [2]])
def test_unknown_version_is_refused(saved, version):
    (problem,) = _load_problems(dict(saved, version=version))
    assert problem == (
        f"unknown format version {_compact(version)} "
        f"(this torchroof reads 1-{TRACE_FORMAT_VERSION})"
    )


def test_file_without_version_is_refused_with_how_to_resave(saved):
    # No torchroof wrote a trace without a version (it has been written since the first
    # format); such a file was written or edited by hand, so it is refused, not guessed at.
    data = dict(saved)
    del data["version"]
    (problem,) = _load_problems(data)
    assert problem.startswith("no format version")
    assert "re-save" in problem and "--save-trace PATH" in problem and "Trace.save" in problem


def test_version_1_file_loads_without_a_count_check(train_step, saved):
    # version 1 (saved before the op count was recorded): every check but the count, and
    # its completeness assumed, as documented in Trace.from_dict and the README
    data = dict(saved, version=1)
    del data["op_count"]
    loaded = Trace.from_dict(data)
    assert [op.to_json() for op in loaded.ops] == [op.to_json() for op in train_step.ops]
    half = dict(data, ops=data["ops"][: len(data["ops"]) // 2])
    assert len(Trace.from_dict(half)) == len(data["ops"]) // 2
    spoiled = copy.deepcopy(data)
    spoiled["ops"][0]["phase"] = "sideways"
    (problem,) = _load_problems(spoiled)
    assert problem.startswith("ops[0] (") and 'phase "sideways" is not one of' in problem


def test_version_2_assumptions_get_their_kind_from_the_sentence_capture_wrote(saved):
    # format 2 saved [op index, module, what]; the kind is read back from the only three
    # sentences capture wrote for routed tokens, every other answer is a scalar
    data = dict(
        saved,
        version=2,
        assumptions=[
            [3, "model.layers.0.mlp", "nonzero of bool [8]: 1 of 8 selected (balanced)"],
            [5, "model.layers.0.mlp", "Tensor.tolist() on torch.int64 answered [1, 1]"],
            [9, "model", "Tensor.item() on torch.bool answered False"],
        ],
    )
    kinds = [a.kind for a in Trace.from_dict(data).assumptions]
    assert kinds == ["routing", "routing", "scalar"]


def test_step_facts_are_checked_by_field(saved):
    data = dict(saved, metadata={"tokens": "many", "cache": 3, "colour": "blue"})
    assert _load_problems(data) == [
        '"metadata"."tokens" is "many", not int',
        '"metadata"."cache" is 3, not str',
        '"metadata" has an unknown field "colour"',
    ]
    kinds = dict(saved, assumptions=[[0, "", "Tensor.item() answered 0", "guess"]])
    (problem,) = _load_problems(kinds)
    assert problem.startswith("assumptions[0] is") and "'routing'" in problem


def test_foreign_json_is_not_a_trace(saved):
    for data in ({"ops": []}, dict(saved, format="other"), "trace", 3, None):
        problems = _load_problems(data)
        assert len(problems) == 1 and problems[0].startswith("not a torchroof trace")


# -- fields and ops ------------------------------------------------------------------------


def test_missing_fields_are_named(saved):
    data = {k: v for k, v in saved.items() if k not in ("op_count", "roles", "metadata")}
    assert _load_problems(data) == ['missing "metadata", "roles", "op_count"']


def test_every_op_problem_is_collected(saved):
    data = copy.deepcopy(saved)
    ops = data["ops"]
    mm = next(i for i, op in enumerate(ops) if op["op"] == "aten.mm.default")
    ops[mm]["in"][0][1] = ops[mm]["in"][0][1] + [1]  # stride one longer than shape
    ops[mm]["in"][1][2] = "bfloat17"
    ops[mm]["args"]["mat2"] = {"$t": 7}
    ops[mm]["phase"] = "sideways"
    ops[0]["op"] = 42
    ops[1]["in"] = "x"
    ops[2]["i"] = 0  # not above the op before
    del ops[3]["module"]
    ops[4]["out"][0] = [[2, 2], [2, 1], "float32"]
    ops[5]["in"][0][4] = -1  # negative storage offset
    data["roles"]["x"] = "weights"
    problems = _load_problems(data)
    name = ops[mm]["op"]
    assert problems == [
        "ops[0]: name 42 is not an overload (e.g. aten.mm.default)",
        f'ops[1] ({ops[1]["op"]}): "in" is a string, not a list of tensors',
        f'ops[2] ({ops[2]["op"]}): "i" is 0, not above the op before\'s (1)',
        f'ops[3] ({ops[3]["op"]}): missing "module"',
        f'ops[4] ({ops[4]["op"]}) out[0]: [[2,2],[2,1],"float32"] is not '
        "[shape, stride, dtype, storage, offset]",
        f"ops[5] ({ops[5]['op']}) in[0]: offset -1 is not a non-negative integer",
        f'ops[{mm}] ({name}): phase "sideways" is not one of '
        "['forward', 'backward', 'recompute', 'optimizer']",
        f"ops[{mm}] ({name}) in[0]: shape {_compact(ops[mm]['in'][0][0])} and stride "
        f"{_compact(ops[mm]['in'][0][1])} differ in length",
        f'ops[{mm}] ({name}) in[1]: unknown dtype "bfloat17"',
        f"ops[{mm}] ({name}) args.mat2: tensor reference 7 points at no input (the op has 2)",
        '"roles" key "x" is not a storage id (an integer)',
    ]
    with pytest.raises(TraceFileError) as caught:
        Trace.from_dict(data)
    total, listed, left = _parse(str(caught.value), None)
    assert (total, listed, left) == (len(problems), problems[:5], 6)  # 11 = 5 listed + 6


def test_error_is_a_value_error_naming_the_file(saved, tmp_path):
    path = _write(tmp_path, dict(saved, ops={}))
    with pytest.raises(ValueError) as caught:
        Trace.load(path)
    assert isinstance(caught.value, TraceFileError) and caught.value.path == path
    assert str(caught.value) == f'trace {path}: "ops" is an object, not a list'


# -- the round trip ------------------------------------------------------------------------


def test_round_trip_loads_and_prices_identically(train_step, tmp_path, capsys):
    path = tmp_path / "step.json"
    train_step.save(path)
    loaded = Trace.load(path)
    assert [op.to_json() for op in loaded.ops] == [op.to_json() for op in train_step.ops]
    assert loaded.to_dict() == json.loads(path.read_text())
    assert (loaded.parameters, loaded.roles, loaded.role_bytes, loaded.assumptions) == (
        train_step.parameters,
        train_step.roles,
        train_step.role_bytes,
        train_step.assumptions,
    )
    assert {op.phase for op in loaded.ops} == {"forward", "backward", "optimizer"}
    for hardware in ("h100-sxm", "a100"):
        assert loaded.estimate(hardware).to_dict() == train_step.estimate(hardware).to_dict()
    # and through the command line
    out = tmp_path / "est.json"
    assert main(["estimate", "--from-trace", str(path), "--json", str(out)]) == 0
    assert "step time" in capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(estimate_json(train_step.estimate("h100-sxm")))
