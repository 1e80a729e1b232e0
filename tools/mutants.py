"""Mutation testing of the modules that carry jaxnitro's guarantees (`make mutants`).

cosmic-ray (the dev extra) changes one thing at a time in a module (`<` to `<=`, `True` to
`False`, `and` to `or`, a number, a raised exception...) and runs the fast tests that cover
it: a mutant the tests still pass on ("survived") is a change of behaviour no test notices.

Each target runs in a copy of the tree (src/, tests/, pyproject.toml), so an interrupted run
never leaves a mutated file behind, and keeps its session in `mutants/<target>.sqlite`: run
the command again to continue where it stopped. The report, `mutants/<target>.txt`, has the
score and the diff of every survivor. Left out of every session, with the reason:

- mutations inside type annotations: with `from __future__ import annotations` they are
  strings Python never evaluates, so `Path | None` -> `Path + None` changes nothing;
- functions named in a target's `skip` (with the reason next to them).

A whole package has hundreds of mutants (about a minute each here); `--sample N` tests a
seeded random sample of N of them instead, and the report gives the score's 95% interval
(Wilson) for the whole. The sample is drawn when the session is made; the others are left
out with the reason "not in the sample".

Usage:
    python tools/mutants.py                  # every target (hours: not part of CI)
    python tools/mutants.py resume fingerprint-key   # some
    python tools/mutants.py --sample 20 --seed 0 steps dist   # estimates
    python tools/mutants.py --list
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mutants"
FAST = "not slow and not multi_device"


@dataclasses.dataclass(frozen=True)
class Target:
    """One session: the module (or package) mutated, the functions kept (None: all), and the
    pytest arguments that select the tests covering it."""

    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] | None = None
    skip: tuple[str, ...] = ()  # functions left out, each with its reason in the comment
    timeout: float = 300.0  # a mutant that loops forever counts as killed after this


TARGETS: dict[str, Target] = {
    # The narrow targets: the code of a resume, a checkpoint commit and a program key.
    "resume": Target(
        "src/jaxnitro/_src/run/setup/rundir.py",
        functions=("resume_record", "identity", "read_meta", "restore_loggers"),
        tests=(
            "tests/unit/core/test_errors.py::test_resume_true_without_a_checkpoint",
            "tests/unit/core/test_errors.py::test_resume_from_a_missing_path",
            "tests/unit/run/test_services.py",
            "tests/unit/run/test_resume_record.py",
            # (the resume-equals-a-straight-run tests train several runs: minutes per mutant)
        ),
    ),
    "checkpoint-commit": Target(
        "src/jaxnitro/_src/checkpoint/store.py",
        functions=("_free_name", "_write_atomically", "_commit"),
        tests=(
            "tests/unit/checkpoint/test_checkpoint_commit.py",
            "tests/unit/checkpoint/test_checkpoint.py",
            "tests/unit/checkpoint/test_checkpoint_files.py",
            "-m",
            FAST,
            "-k",
            "not a_relative_checkpoint_path_loads",  # 20 s of training, no commit check
        ),
    ),
    "fingerprint-key": Target(
        "src/jaxnitro/_src/compile/fingerprint.py",
        functions=("_identity", "_forget", "_array_digest"),
        tests=(
            "tests/unit/compile/test_fingerprint.py",
            "tests/unit/compile/test_fingerprint_reach.py",
        ),
    ),
    # The packages, whole, against their folders' fast tests (not run yet: hours each).
    "compile": Target("src/jaxnitro/_src/compile", tests=("tests/unit/compile", "-m", FAST)),
    "programs": Target("src/jaxnitro/_src/programs", tests=("tests/unit/compile", "-m", FAST)),
    "run-setup": Target("src/jaxnitro/_src/run/setup", tests=("tests/unit/run", "-m", FAST)),
    "checkpoint": Target(
        "src/jaxnitro/_src/checkpoint", tests=("tests/unit/checkpoint", "-m", FAST)
    ),
    "steps": Target("src/jaxnitro/_src/steps", tests=("tests/unit/steps", "-m", FAST)),
    "dist": Target(
        "src/jaxnitro/_src/dist",
        tests=(
            "tests/unit/dist",
            "tests/e2e/test_warm_start.py::test_where_the_cache_lives",  # cache_dir_choice
            "-m",
            FAST,
        ),
    ),
}


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, as (line, column), of every annotation in `source`."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        notes = []
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            notes.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            notes.append(node.returns)
        for note in notes:
            end = (note.end_lineno or note.lineno, note.end_col_offset or 0)
            spans.append(((note.lineno, note.col_offset), end))
    return spans


def kept(mutation, target: Target, spans_of) -> bool:
    """Whether a mutation is tested: in a kept function and not in an annotation."""
    name = mutation.definition_name
    if target.functions is not None and name not in target.functions:
        return False
    if name in target.skip:
        return False
    start = tuple(mutation.start_pos)
    return not any(a <= start < b for a, b in spans_of(mutation.module_path))


def _copy_tree(dest: Path) -> None:
    for name in ("src", "tests"):
        shutil.copytree(
            ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _cosmic_ray(*args: str, cwd: Path, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", *args], cwd=cwd, env=env, check=True)


NOT_SAMPLED = "not in the sample"


def choose(job_ids: list[str], n: int, seed: int) -> set[str]:
    """The seeded sample of `n` of `job_ids` (all of them when there are no more)."""
    ids = sorted(job_ids)
    return set(random.Random(seed).sample(ids, min(n, len(ids))))


def wilson(killed: int, tested: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% (Wilson score) interval of the kill rate behind `killed` of `tested`."""
    if not tested:
        return 0.0, 1.0
    p = killed / tested
    mid = (p + z * z / (2 * tested)) / (1 + z * z / tested)
    half = z * math.sqrt(p * (1 - p) / tested + z * z / (4 * tested * tested))
    half /= 1 + z * z / tested
    return max(0.0, mid - half), min(1.0, mid + half)


def run(name: str, target: Target, sample: int | None = None, seed: int = 0) -> dict:
    """Run (or continue) one target's session; returns its counts. `sample`: test a seeded
    sample of that many of its mutants (drawn once, when the session is made)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    OUT.mkdir(exist_ok=True)
    session = OUT / f"{name}.sqlite"
    with tempfile.TemporaryDirectory(prefix=f"jaxnitro-mutants-{name}-") as tmp:
        work = Path(tmp)
        _copy_tree(work)
        test_command = " ".join(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
            + [f"'{a}'" if " " in a else a for a in target.tests]
        )
        config = work / "cosmic-ray.toml"
        config.write_text(
            textwrap.dedent(f"""\
                [cosmic-ray]
                module-path = "{target.path}"
                timeout = {target.timeout}
                excluded-modules = []
                test-command = "{test_command}"

                [cosmic-ray.distributor]
                name = "local"
                """)
        )
        new = not session.exists()
        if new:
            _cosmic_ray("init", str(config), str(session), cwd=work)
        spans: dict[Path, list] = {}

        def spans_of(path: Path) -> list:
            if path not in spans:
                spans[path] = annotation_spans((work / path).read_text())
            return spans[path]

        with use_db(str(session), WorkDB.Mode.open) as db:  # (again on a continued run)
            left_out = [
                item.job_id
                for item in db.pending_work_items
                if not all(kept(m, target, spans_of) for m in item.mutations)
            ]
            if left_out:
                db.set_multiple_results(
                    left_out,
                    WorkResult(
                        worker_outcome=WorkerOutcome.SKIPPED,
                        output="left out: an annotation or a function not in the target",
                    ),
                )
            if new and sample is not None:
                pending = [item.job_id for item in db.pending_work_items]
                kept_ids = choose(pending, sample, seed)
                db.set_multiple_results(
                    [j for j in pending if j not in kept_ids],
                    WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=NOT_SAMPLED),
                )
        env = {**os.environ, "PYTHONPATH": str(work / "src"), "JAX_PLATFORMS": "cpu"}
        _cosmic_ray("exec", str(config), str(session), cwd=work, env=env)
    return report(name, session)


_PENDING = "pending: set aside while the survivors were tested again"


def retest(name: str, target: Target) -> dict:
    """Test the survivors again (after tests were added): `mutants/<name>.before.txt` keeps
    the report as it was; mutants not run yet stay so."""
    import sqlite3

    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    session = OUT / f"{name}.sqlite"
    report(name, session, suffix=".before")
    with use_db(str(session), WorkDB.Mode.open) as db:
        results = dict(db.results)
        survivors = [j for j, r in results.items() if r.test_outcome == TestOutcome.SURVIVED]
        pending = [item.job_id for item in db.work_items if item.job_id not in results]
        db.set_multiple_results(
            pending, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=_PENDING)
        )
    with sqlite3.connect(session) as con:
        con.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in survivors])
    try:
        run(name, target)
    finally:
        with sqlite3.connect(session) as con:
            con.execute("DELETE FROM work_results WHERE output = ?", (_PENDING,))
    return report(name, session)


def report(name: str, session: Path, suffix: str = "") -> dict:
    """Write mutants/<name>.txt (score, survivors' diffs); return the counts."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    killed, survived, pending, unsampled = 0, [], 0, 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in db.work_items:
            result = results.get(item.job_id)
            if result is None:
                pending += 1
            elif result.worker_outcome == WorkerOutcome.SKIPPED:
                unsampled += result.output == NOT_SAMPLED
                continue
            elif result.test_outcome == TestOutcome.SURVIVED:
                survived.append((item, result))
            else:
                killed += 1
    tested = killed + len(survived)
    score = f"{100 * killed / tested:.1f}%" if tested else "n/a"
    head = (
        f"{name}: {killed} of {tested} mutants killed ({score}), {len(survived)} survived, "
        f"{pending} not run yet"
    )
    if unsampled:
        low, high = wilson(killed, tested)
        head += (
            f"; a sample of {tested + pending} of {tested + pending + unsampled} mutants, "
            f"the whole's score 95% within {100 * low:.0f}-{100 * high:.0f}%"
        )
    lines = [head, ""]
    for item, result in survived:
        (m,) = item.mutations
        where = f"{m.module_path}:{m.start_pos[0]} in {m.definition_name}"
        lines.append(f"--- {where}: {m.operator_name}")
        lines.append((result.diff or "").strip())
        lines.append("")
    (OUT / f"{name}{suffix}.txt").write_text("\n".join(lines))
    print(lines[0])
    return {
        "killed": killed,
        "survived": len(survived),
        "pending": pending,
        "not_sampled": unsampled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"any of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--list", action="store_true", help="list the targets and stop")
    parser.add_argument("--report", action="store_true", help="only rewrite the reports")
    parser.add_argument(
        "--retest", action="store_true", help="test the survivors again (after adding tests)"
    )
    parser.add_argument(
        "--sample", type=int, metavar="N", help="a new session tests a seeded sample of N mutants"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    args = parser.parse_args(argv)
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample {args.sample}: give a number of mutants, 1 or more")
    if args.list:
        for name, t in TARGETS.items():
            print(f"{name:18} {t.path} {list(t.functions or ['(all)'])} <- {' '.join(t.tests)}")
        return 0
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; pick from {list(TARGETS)}")
    for name in args.targets or list(TARGETS):
        if args.report:
            report(name, OUT / f"{name}.sqlite")
        elif args.retest:
            retest(name, TARGETS[name])
        else:
            if args.sample is not None and (OUT / f"{name}.sqlite").exists():
                print(f"{name}: continuing its session; --sample applies to a new one only")
            run(name, TARGETS[name], sample=args.sample, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
