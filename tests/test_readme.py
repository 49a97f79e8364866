"""Every fenced code block of README.md and of every page under docs/ runs as written.

What runs, one test per block (its id is the file, the line and the language):

- ```python: the block, unchanged, as a script run by a fresh interpreter (this one);
- ```bash / ```sh: each command line in bash (a trailing ``\\`` joins lines);
  ```console: each ``$ `` line in bash, the other lines being its printed output;
- ```toml: loaded as a hardware file with ``torchroof.hardware.get`` (the README's TOML is
  its example hardware spec, which must be accepted as written).

Unlabelled fences (and ``text``) are printed output or command synopses and are not run.

The skip rules, the only ones:

1. A block right after a ``<!-- no-test: reason -->`` line is skipped with that reason (a
   GPU, the network, or a run too long for a test suite, said in the page itself).
2. In shell blocks, the install and test-suite steps: ``python3 -m venv``, ``pip install``,
   ``pytest`` and ``.ci/run`` (the environment these tests run in is that install, and the
   suite is what is running). The rest of an ``&&`` chain runs, so the README's first line
   runs its ``torchroof estimate``.
3. ``.venv/bin/X`` runs as the ``X`` installed beside this interpreter: the README's
   ``.venv`` is the environment the tests run in.

Blocks run in a fresh temporary directory holding links to the repository's top-level
entries: relative paths (``examples/…``) resolve, and new files a block writes
(``llama.json``) land in the temporary directory. Each block passes when every command exits
0 and prints no Python traceback. Measured on the 2-core development machine, shared: the
README's runnable blocks take about a minute together (the slowest, the two comparisons
and the sweep of the "three questions" block, about 30 s); a docs block that repeats one of
them is marked no-test.

Beside the blocks: README.md is at most 200 lines (the manual is docs/), and neither it nor
any docs page uses the project's internal shorthand (see ``SHORTHAND``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
README_MAX_LINES = 200
# words of the project's own notes that mean nothing to a reader: say what they stand for
SHORTHAND = re.compile(r"\b(seed|lab\s+\d+|issue\s+\d+|design)\b", re.IGNORECASE)

SHELL = {"bash", "sh", "console"}
RUN = SHELL | {"python", "toml"}
SHOWN = {"", "text"}  # output and synopses: never run
BLOCK_TIMEOUT_S = 300

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
NO_TEST = re.compile(r"^\s*<!--\s*no-test:\s*(?P<reason>.+?)\s*-->\s*$")
# rule 2: the install and test-suite steps of a shell command
NOT_RUN_STEPS = (
    re.compile(r"^(\S*/)?python3?\s+-m\s+venv\b"),
    re.compile(r"^(\S*/)?pip3?\s+install\b|-m\s+pip\s+install\b"),
    re.compile(r"\bpytest\b"),
    re.compile(r"(^|\s|/)\.ci/run\b"),
)


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence in its page
    lang: str
    text: str
    no_test: str | None  # the reason, when a <!-- no-test: ... --> marker precedes it
    page: str = "README.md"  # the file, relative to the repository

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}-{self.lang or 'plain'}"


def fenced_blocks(markdown: str, page: str = "README.md") -> list[Block]:
    """Every fenced block in order, dedented by its fence's indent."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    at = 0
    while at < len(lines):
        opening = FENCE.match(lines[at])
        if not opening:
            at += 1
            continue
        indent, lang = opening["indent"], opening["lang"].lower()
        end = at + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{at + 1}: ``` fence never closed")
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[at + 1 : end]
        ]
        previous = next((lines[i] for i in range(at - 1, -1, -1) if lines[i].strip()), "")
        marker = NO_TEST.match(previous)
        reason = marker["reason"] if marker else None
        blocks.append(Block(at + 1, lang, "\n".join(body) + "\n", reason, page))
        at = end + 1
    return blocks


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block, continuation lines joined; console keeps ``$`` lines."""
    commands: list[str] = []
    pending = ""
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if block.lang == "console":
            if not pending:
                if not line.lstrip().startswith("$ "):
                    continue  # printed output
                line = line.lstrip()[2:]
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append((pending + line).strip())
        pending = ""
    if pending:
        commands.append(pending.strip())
    return commands


def runnable_part(command: str) -> str:
    """Rules 2 and 3: drop install / test-suite steps of an ``&&`` chain, map ``.venv/bin/``."""
    steps = [step.strip() for step in command.split("&&")]
    kept = [step for step in steps if not any(rule.search(step) for rule in NOT_RUN_STEPS)]
    return " && ".join(step.replace(".venv/bin/", "") for step in kept)


def _workdir(tmp_path: Path) -> Path:
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # `torchroof`, `python` resolve to this interpreter's environment (rule 3)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


def _run(argv: list[str], cwd: Path, what: str) -> None:
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    tail = (
        f"{what}\n--- stdout (tail)\n{done.stdout[-3000:]}"
        f"\n--- stderr (tail)\n{done.stderr[-3000:]}"
    )
    assert done.returncode == 0, f"exit code {done.returncode}: {tail}"
    assert "Traceback (most recent call last)" not in done.stdout + done.stderr, tail


def _page_name(path: Path) -> str:
    return str(path.relative_to(REPO))


BLOCKS = [b for path in PAGES for b in fenced_blocks(path.read_text(), _page_name(path))]
README_BLOCKS = [b for b in BLOCKS if b.page == "README.md"]


def test_every_block_is_run_or_shown():
    """A block in a language this file neither runs nor knows as output (```py, ```shell)
    would silently escape the check; name it here first."""
    unknown = [(b.page, b.line, b.lang) for b in BLOCKS if b.lang not in RUN | SHOWN]
    assert unknown == []
    langs = {b.lang for b in README_BLOCKS if b.no_test is None}
    assert {"python", "bash"} <= langs  # the extraction finds the README's examples
    assert {b.page for b in BLOCKS} > {"README.md", "docs/guide/cli.md"}  # and the docs'


def test_the_readme_is_one_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the manual is docs/"


def test_no_page_uses_internal_shorthand():
    found = [
        f"{_page_name(path)}:{number}: {match[0]!r}"
        for path in PAGES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in SHORTHAND.finditer(line)
    ]
    assert found == []
    assert SHORTHAND.search("as the Seed says") and SHORTHAND.search("Lab 3 and issue 12")
    assert not SHORTHAND.search("seeds, a laboratory, the issue order, designer")


def test_shell_rules_keep_the_estimate_of_the_first_command():
    first = next(b for b in README_BLOCKS if b.lang in SHELL)
    commands = [runnable_part(c) for c in shell_commands(first)]
    # install steps and the suite are dropped, the estimate after them runs
    assert commands[0] == "torchroof estimate"
    assert runnable_part('.venv/bin/pip install -e ".[dev]"') == ""
    assert (
        runnable_part("bash .ci/run") == "" and runnable_part(".venv/bin/python -m pytest -q") == ""
    )


def test_extraction_reads_markers_prompts_and_indented_fences():
    markdown = "\n".join(
        [
            "text",
            "<!-- no-test: needs a GPU -->",
            "```bash",
            "torchroof validate llama-3-8b \\",
            "  --device cuda",
            "```",
            "- item:",
            "    ```console",
            "    $ torchroof models",
            "    llama-3-8b",
            "    # not a comment: output",
            "    ```",
            "```",
            "printed output",
            "```",
        ]
    )
    gpu, console, shown = fenced_blocks(markdown)
    assert (gpu.line, gpu.lang, gpu.no_test) == (3, "bash", "needs a GPU")
    assert shell_commands(gpu) == ["torchroof validate llama-3-8b    --device cuda"]
    assert (console.lang, console.no_test) == ("console", None)
    assert shell_commands(console) == ["torchroof models"]  # the $ line, not its output
    assert (shown.lang, shown.text) == ("", "printed output\n")
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks("```python\nprint(1)\n")


def test_a_failing_block_fails(tmp_path):
    with pytest.raises(AssertionError, match="exit code 3"):
        _run(["bash", "-c", "exit 3"], tmp_path, "a failing command")
    with pytest.raises(AssertionError, match="Traceback"):
        _run(
            [
                sys.executable,
                "-c",
                "import sys; sys.stderr.write('Traceback (most recent call last)')",
            ],
            tmp_path,
            "x",
        )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in RUN], ids=lambda b: b.id)
def test_block_runs_as_written(block: Block, tmp_path: Path):
    if block.no_test is not None:
        pytest.skip(f"{block.page}:{block.line} is marked no-test: {block.no_test}")
    cwd = _workdir(tmp_path)
    where = f"{block.page}:{block.line} ```{block.lang}"
    if block.lang == "python":
        script = cwd / f"readme_line_{block.line}.py"
        script.write_text(block.text)
        _run([sys.executable, script.name], cwd, f"{where}\n{block.text}")
    elif block.lang == "toml":
        from torchroof.hardware import get

        path = cwd / f"readme_line_{block.line}.toml"
        path.write_text(block.text)
        spec = get(str(path))  # raises HardwareSpecError naming every problem
        assert spec.name in block.text
    else:
        commands = [c for c in map(runnable_part, shell_commands(block)) if c]
        if not commands:
            pytest.skip(f"{where}: only install / test-suite steps (skip rule 2)")
        for command in commands:
            _run(["bash", "-c", command], cwd, f"{where}: $ {command}")
