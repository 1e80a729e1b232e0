"""Every Python and shell block of README.md and docs/ runs as written, or says why not.

A page's blocks run in order in one subprocess (one namespace, one JAX start-up per page), in
a fresh directory holding a link to `examples/`, with `jaxnitro` on the PATH. Markers, as
HTML comments that the rendered page does not show:

- `<!-- doc-test: setup=quickstart -->` anywhere on a page: its blocks build on the quick
  start. The setup runs the quick start block of docs/getting-started.md as written, but
  for 1 epoch instead of 10 (`MnistMLP`, a trained `n` and its `runs/MnistMLP` exist);
  `setup=quickstart-class` runs only its definitions, as written (nothing trained).
- `<!-- not-run: REASON -->` on the line before a block: the block is not run; the reason
  (what it needs that CI has not: a cluster, a server, a package index) is required.

A block that raises, or a shell block that exits non-zero, fails its page's test with the
block's file and line. Untagged blocks that look like commands must be tagged, so a shell
block cannot hide from this test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import paths
from helpers.procs import child_env

ROOT = paths.ROOT
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->\s*$")
SETUP = re.compile(r"<!--\s*doc-test:\s*setup=([\w-]+)\s*-->")
# The first word of an untagged block that makes it a command someone would paste.
COMMANDS = ("$ ", "jaxnitro ", "curl ", "python ", "pip ", "make ", "docker ", "kubectl ", "srun ")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None  # the not-run reason, or None


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)
    return [ROOT / "README.md", *docs]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    name = _name(page)
    found = []
    for m in FENCE.finditer(text):
        lang = m.group(2).lower()
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        code = textwrap.dedent(m.group(3))
        found.append(Block(name, line, lang, code, skip.group(1).strip() if skip else None))
    return found


def setup_of(page: Path) -> str | None:
    found = SETUP.findall(page.read_text())
    assert len(found) <= 1, f"{page.name}: more than one doc-test setup line"
    return found[0] if found else None


def quickstart() -> str:
    """The quick start of docs/getting-started.md, as written but for 1 epoch instead of 10."""
    code = _quickstart_block().code
    written = "max_epochs: int = 10"
    assert code.count(written) == 1, "the quick start's max_epochs line changed"
    return code.replace(written, "max_epochs: int = 1")


def quickstart_class() -> str:
    """The quick start's definitions, as written: everything before its `n = jn.Nitro(`."""
    code = _quickstart_block().code
    assert code.count("\nn = jn.Nitro(") == 1, "the quick start's handle line changed"
    return code.split("\nn = jn.Nitro(")[0]


def _quickstart_block() -> Block:
    return next(b for b in blocks(ROOT / "docs" / "getting-started.md") if b.lang in PYTHON)


SETUPS = {"quickstart": quickstart, "quickstart-class": quickstart_class}

# Runs in the page's subprocess: each block in order, python in one namespace, shell by bash.
RUNNER = r"""
import json, os, subprocess, sys, traceback
todo = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in todo:
    print(f"\n=== doc block {b['where']} ({b['lang']})", flush=True)
    if b["lang"] in ("python", "py", "setup"):
        try:
            exec(compile(b["code"], b["where"], "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"DOC BLOCK FAILED: {b['where']}", flush=True)
            sys.exit(1)
    else:
        code = b["code"]
        if b["lang"] == "console":  # the commands only, not their output
            code = "\n".join(l[2:] for l in code.splitlines() if l.startswith("$ "))
        sys.stdout.flush()
        rc = subprocess.run(["bash", "-euo", "pipefail", "-c", code]).returncode
        if rc:
            print(f"DOC BLOCK FAILED: {b['where']} (exit status {rc})", flush=True)
            sys.exit(1)
print("\nDOC BLOCKS OK", flush=True)
"""


def run_page(page: Path, tmp_path: Path) -> str:
    todo = []
    setup = setup_of(page)
    if setup is not None:
        assert setup in SETUPS, f"{page.name}: unknown doc-test setup {setup!r}; {sorted(SETUPS)}"
        todo.append({"where": f"<setup {setup}>", "lang": "setup", "code": SETUPS[setup]()})
    for b in blocks(page):
        if b.skip is None and b.lang in PYTHON + SHELL:
            todo.append({"where": f"{b.page}:{b.line}", "lang": b.lang, "code": b.code})
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "blocks.json").write_text(json.dumps(todo))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = child_env(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        MPLBACKEND="Agg",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "DOC BLOCKS OK" in out, (
        f"a documentation block of {_name(page)} failed when run as written; fix "
        f"the block, or mark it <!-- not-run: REASON --> if CI cannot run it:\n{out[-6000:]}"
    )
    return out


def _param(page: Path):
    return pytest.param(page, id=_name(page))


RUNNABLE = [
    p for p in pages() if any(b.skip is None and b.lang in PYTHON + SHELL for b in blocks(p))
]


# Each page starts a Python with JAX (2 to 50 CPU s): the slow tier.
@pytest.mark.slow
@pytest.mark.parametrize("page", [_param(p) for p in RUNNABLE])
def test_the_blocks_of_a_page_run_as_written(page, tmp_path):
    run_page(page, tmp_path)


def test_every_skip_says_why_and_every_command_block_is_tagged():
    problems = []
    for page in pages():
        for b in blocks(page):
            if b.skip is not None and len(b.skip) < 10:
                problems.append(f"{b.page}:{b.line}: not-run without a reason: {b.skip!r}")
            first = b.code.lstrip().splitlines()[0] if b.code.strip() else ""
            if b.lang == "" and first.startswith(COMMANDS):
                problems.append(f"{b.page}:{b.line}: an untagged command block; tag it ```bash")
    assert not problems, "\n".join(problems)


def test_a_failing_block_fails_its_page(tmp_path):
    """The harness itself: a block that raises, or a command that fails, is reported with
    its line; a not-run block is not run."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not-run: would fail, and says so -->\n```python\nraise SystemExit(3)\n```\n"
        "```python\nx = 1\n```\n\n```bash\ntest -d examples\nfalse\n```\n"
    )
    found = blocks(page)
    assert [(b.line, b.lang, b.skip) for b in found] == [
        (2, "python", "would fail, and says so"),
        (5, "python", None),
        (9, "bash", None),
    ]
    with pytest.raises(AssertionError, match=r"page\.md:9 \(exit status 1\)"):
        run_page(page, tmp_path)
