"""A bundle's git provenance is read without running anything the repository chooses.

Each test plants a program in a real git repository (through `core.fsmonitor`, a clean
filter, a `post-index-change` hook, an `include.path`, a submodule's config) that would
create a marker file if git ran it, checks that a plain `git status` does run it (in a copy),
then reads the provenance of a run directory inside it: no marker may appear, and the commit
is still recorded.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.export.provenance import git_state

pytestmark = [
    pytest.mark.skipif(shutil.which("git") is None, reason="needs git"),
    pytest.mark.filterwarnings("ignore:export_model.*no optimizer step"),
]


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "core.fsmonitor=false", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1"},
    )
    return out.stdout.strip()


def _repo(tmp_path: Path, name: str = "repo", *, args: tuple[str, ...] = ()) -> Path:
    """A repository with one commit of `train.py` and an untracked run directory."""
    repo = tmp_path / name
    (repo / "runs" / "tiny").mkdir(parents=True)
    (repo / "train.py").write_text("print(1)\n")
    _git(repo, "init", "-q", *args)
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-qm", "first")
    return repo


def _plant(tmp_path: Path, repo: Path, what: str) -> list[Path]:
    """Configure `repo` to run a program that touches a marker; the markers to look for."""
    marker = tmp_path / f"marker-{what}"
    touch = f"touch {shlex.quote(str(marker))}"
    if what == "fsmonitor":
        _git(repo, "config", "core.fsmonitor", f"{touch}; false")
    elif what == "filter":  # a clean filter runs when git hashes a changed file
        (repo / ".gitattributes").write_text("* filter=evil\n")
        _git(repo, "config", "filter.evil.clean", f"{touch}; cat")
        _git(repo, "config", "filter.evil.process", touch)
        (repo / "train.py").write_text("print(2)\n")  # changed: status must hash it
    elif what == "hook":  # git runs post-index-change when status refreshes the index
        hook = repo / ".git" / "hooks" / "post-index-change"
        hook.parent.mkdir(exist_ok=True)
        hook.write_text(f"#!/bin/sh\n{touch}\n")
        hook.chmod(0o755)
        later = (repo / "train.py").stat().st_mtime + 100  # the same bytes, a new time
        os.utime(repo / "train.py", (later, later))
    elif what == "include":  # the settings hide in another file that the config includes
        extra = repo / ".git" / "extra.cfg"
        extra.write_text(f"[core]\n\tfsmonitor = {touch}; false\n")
        _git(repo, "config", "include.path", str(extra))
    elif what == "submodule":  # `git status` runs `git status` inside each submodule
        sub = _repo(tmp_path, "sub")
        _git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "sub")
        _git(repo, "commit", "-qm", "sub")
        _git(repo / "sub", "config", "core.fsmonitor", f"{touch}; false")
        (repo / "sub" / "train.py").write_text("print(3)\n")
    return [marker]


def _plain_status_runs_it(tmp_path: Path, repo: Path, markers: list[Path]) -> bool:
    """Whether a plain `git status` (the repository's config, hooks and attributes as they
    are) runs the planted program: asked of a copy, so the repository itself stays as it
    was; the markers are removed again."""
    copy = tmp_path / "control"
    shutil.copytree(repo, copy, symlinks=True)
    subprocess.run(
        ["git", "status", "--porcelain"],
        cwd=copy,
        capture_output=True,
        env={"PATH": os.environ["PATH"], "HOME": str(copy), "GIT_CONFIG_NOSYSTEM": "1"},
    )
    ran = any(m.exists() for m in markers)
    for m in markers:
        m.unlink(missing_ok=True)
    return ran


@pytest.mark.parametrize("what", ["fsmonitor", "filter", "hook", "include", "submodule"])
def test_provenance_runs_nothing_the_repository_configures(tmp_path, what):
    repo = _repo(tmp_path)
    markers = _plant(tmp_path, repo, what)
    # The plant is live: git run the ordinary way would run it (else this test proves nothing).
    assert _plain_status_runs_it(tmp_path, repo, markers), f"plain git ignores the {what} plant"
    head = _git(repo, "rev-parse", "HEAD")
    state = git_state(repo / "runs" / "tiny")
    assert not [m for m in markers if m.exists()], f"provenance ran the planted {what} program"
    assert state["commit"] == head
    if what != "filter":  # a clean filter's dirt is seen only when git's stat data is racy
        assert state["dirty"] is False


@pytest.mark.slow
def test_export_model_runs_no_fsmonitor_of_the_run_dirs_repository(tmp_path):
    """The audit's reproduction, through jn.export_model."""
    repo = _repo(tmp_path)
    head = _git(repo, "rev-parse", "HEAD")
    marker = tmp_path / "marker"
    _git(repo, "config", "core.fsmonitor", f"touch {shlex.quote(str(marker))}; false")
    n = nitro(Tiny(max_epochs=1), run_dir=repo / "runs" / "tiny")
    path = jn.export_model(n, tmp_path / "bundle", platforms=("cpu",))
    assert not marker.exists(), "export_model ran the repository's core.fsmonitor"
    git = jn.load_bundle(path).manifest["provenance"]["git"]
    assert git == {"commit": head, "dirty": False}


def test_commit_from_packed_refs_detached_heads_and_worktrees(tmp_path):
    repo = _repo(tmp_path)
    head = _git(repo, "rev-parse", "HEAD")
    _git(repo, "pack-refs", "--all")
    assert not (repo / ".git" / "refs" / "heads" / "master").exists()
    assert not (repo / ".git" / "refs" / "heads" / "main").exists()
    assert git_state(repo / "runs" / "tiny") == {"commit": head, "dirty": False}

    (repo / "train.py").write_text("print(2)\n")
    _git(repo, "commit", "-qam", "second")
    second = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "--detach", head)
    assert git_state(repo / "runs")["commit"] == head

    worktree = tmp_path / "wt"
    _git(repo, "worktree", "add", "-q", "--detach", str(worktree), second)
    (worktree / "runs").mkdir()
    assert git_state(worktree / "runs") == {"commit": second, "dirty": False}
    (worktree / "train.py").write_text("print(9)\n")
    assert git_state(worktree / "runs")["dirty"] is True


def test_sha256_repositories_and_unborn_branches(tmp_path):
    repo = _repo(tmp_path, args=("--object-format=sha256",))
    state = git_state(repo / "runs" / "tiny")
    assert state == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False}
    assert len(state["commit"]) == 64

    fresh = tmp_path / "fresh"
    (fresh / "runs").mkdir(parents=True)
    _git(fresh, "init", "-q")
    assert git_state(fresh / "runs") == {"commit": None, "dirty": None}


def test_a_fifo_where_a_ref_should_be_does_not_hang(tmp_path):
    repo = _repo(tmp_path)
    branch = _git(repo, "symbolic-ref", "HEAD")
    ref = repo / ".git" / branch
    ref.unlink()
    os.mkfifo(ref)
    assert git_state(repo / "runs")["commit"] is None


@pytest.mark.skipif(getattr(os, "geteuid", lambda: 1)() != 0, reason="chown needs root")
def test_a_repository_owned_by_another_user_is_not_read(tmp_path):
    repo = _repo(tmp_path)
    marker = _plant(tmp_path, repo, "fsmonitor")[0]
    for path in (repo, repo / ".git"):
        os.chown(path, 65534, 65534)
    state = git_state(repo / "runs" / "tiny")
    assert not marker.exists()
    assert state["commit"] is None and "owned by another user" in state["unread"]


def test_outside_a_work_tree_there_is_no_git_state(tmp_path):
    assert git_state(tmp_path) is None
