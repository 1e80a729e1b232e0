"""Read a tier log and keep the fast tier fast: list (or mark `slow`) its costliest tests.

    JAXNITRO_TIER_LOG=tiers.txt pytest -q     # a line per test: CPU s, wall s, compile s, tier, id
    python tools/tiers.py tiers.txt                   # per tier: tests, CPU s; the costliest
    python tools/tiers.py tiers.txt --over 1.5        # the fast tests over 1.5 CPU s
    python tools/tiers.py tiers.txt --over 1.5 --apply  # mark them @pytest.mark.slow

A test's CPU seconds depend a little on what ran before it: the first test to need a small
program compiles it into the session's cache, and the tests after it load it. Measure on the
whole tier (`make test-fast`), as a developer runs it, then mark: a parametrized test is
marked whole (its function), and a file gains `import pytest` where it lacks one.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read(log: Path) -> list[tuple[float, float, str, str]]:
    """(CPU s, wall s, tier, test id) per line (of a log with or without the compile
    column); a test logged twice keeps its last line."""
    rows: dict[str, tuple[float, float, str, str]] = {}
    for line in log.read_text().splitlines():
        parts = line.split(" ", 4)
        if len(parts) == 5 and parts[3] in ("fast", "slow"):
            cpu, wall, _, tier, nodeid = parts
        elif len(parts) >= 4 and parts[2] in ("fast", "slow"):
            cpu, wall, tier, nodeid = line.split(" ", 3)
        else:
            continue
        rows[nodeid] = (float(cpu), float(wall), tier, nodeid)
    return list(rows.values())


def summary(rows: list[tuple[float, float, str, str]], top: int) -> str:
    by_tier: dict[str, list[float]] = collections.defaultdict(list)
    for cpu, _, tier, _ in rows:
        by_tier[tier].append(cpu)
    lines = [f"{t}: {len(c)} tests, {sum(c):.0f} CPU s" for t, c in sorted(by_tier.items())]
    fast = sorted((r for r in rows if r[2] == "fast"), reverse=True)
    lines.append(f"the costliest {min(top, len(fast))} fast tests (CPU s, wall s):")
    lines += [f"  {cpu:6.2f} {wall:6.2f}  {nodeid}" for cpu, wall, _, nodeid in fast[:top]]
    return "\n".join(lines)


def functions(nodeids: list[str], root: Path = ROOT) -> dict[Path, set[str]]:
    """The test functions behind test ids, by file (a parametrized test's function once)."""
    found: dict[Path, set[str]] = collections.defaultdict(set)
    for nodeid in nodeids:
        path, _, rest = nodeid.partition("::")
        found[root / path].add(rest.split("::")[-1].split("[")[0])
    return found


def mark(path: Path, names: set[str], marker: str = "slow") -> list[str]:
    """Add `@pytest.mark.<marker>` above each named test function of `path` (one that has it
    already is left as it is); the names marked."""
    lines = path.read_text().splitlines(keepends=True)
    done = []
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^(\s*)(?:async\s+)?def (test_\w+)\(", lines[i])
        if not m or m.group(2) not in names:
            continue
        start = i
        while start > 0 and lines[start - 1].lstrip().startswith("@"):
            start -= 1
        if any(f"pytest.mark.{marker}" in line for line in lines[start:i]):
            continue
        lines.insert(start, f"{m.group(1)}@pytest.mark.{marker}\n")
        done.append(m.group(2))
    text = "".join(lines)
    if done and not re.search(r"^import pytest$", text, flags=re.MULTILINE):
        future = re.compile(r"^from __future__ import annotations\n\n", flags=re.MULTILINE)
        if not future.search(text):
            raise SystemExit(f"{path}: add `import pytest` by hand (no __future__ import)")
        text = future.sub(lambda m: m.group(0) + "import pytest\n", text, count=1)
    path.write_text(text)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="a JAXNITRO_TIER_LOG file")
    parser.add_argument("--over", type=float, help="list the fast tests over this many CPU s")
    parser.add_argument("--apply", action="store_true", help="mark those @pytest.mark.slow")
    parser.add_argument("--top", type=int, default=30, help="how many to show (default 30)")
    parser.add_argument("--root", type=Path, default=ROOT, help="where the test ids start")
    args = parser.parse_args(argv)
    if not args.log.exists():
        parser.error(f"{args.log}: no such file. Run JAXNITRO_TIER_LOG={args.log} pytest first.")
    rows = read(args.log)
    if args.over is None:
        if args.apply:
            parser.error("--apply needs --over SECONDS: which tests to mark")
        print(summary(rows, args.top))
        return 0
    over = sorted((r for r in rows if r[2] == "fast" and r[0] > args.over), reverse=True)
    kept = sum(r[0] for r in rows if r[2] == "fast") - sum(r[0] for r in over)
    for cpu, wall, _, nodeid in over:
        print(f"{cpu:6.2f} {wall:6.2f}  {nodeid}")
    print(
        f"{len(over)} fast tests over {args.over:g} CPU s; the fast tier without them: "
        f"{kept:.0f} CPU s"
    )
    if args.apply:
        for path, names in sorted(functions([r[3] for r in over], args.root).items()):
            marked = mark(path, names)
            print(f"{path.relative_to(args.root)}: marked {len(marked)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
