"""Place test files by what they test: `tests/unit/<area>/` or `tests/e2e/`.

    python tools/place_tests.py            # list the files at tests/ top level and where they go
    python tools/place_tests.py --apply    # `git mv` them there

A file named in PLACES goes where PLACES says. Any other file is placed by what it imports:
the subpackage of jaxnitro it imports most (`from jaxnitro._src.data... import`), else the area its
name starts with (`test_serve_tls.py` -> serve), else `train`. A file that starts processes
with `jaxnitro launch` or `jax.distributed`, or a notebook kernel, goes to e2e. Check a guess
before committing it; add the file to PLACES when the guess is wrong.

After a move, a test that builds paths from `__file__` must use `helpers.paths` instead
(ROOT, SRC, TESTS); the script lists such lines.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

# The package's subpackages: one folder of unit tests each.
AREAS = (
    "core",
    "experiment",
    "run",
    "steps",
    "optim",
    "compile",
    "programs",
    "train",
    "data",
    "checkpoint",
    "dist",
    "observe",
    "export",
    "serve",
    "cli",
)

# Where each known file lives, relative to tests/. "unit" holds the package-wide checks.
PLACES: dict[str, str] = {
    "test_errors.py": "unit/core",
    "test_adapters_driver.py": "unit/experiment",
    "test_experiment.py": "unit/experiment",
    "test_hooks.py": "unit/experiment",
    "test_models.py": "unit/experiment",
    "test_remat.py": "unit/experiment",
    "test_lifecycle.py": "unit/run",
    "test_options.py": "unit/run",
    "test_services.py": "unit/run",
    "test_spine.py": "unit/run",
    "test_background.py": "unit/train",
    "test_startup.py": "unit/run",
    "test_custom_step.py": "unit/steps",
    "test_ema.py": "unit/steps",
    "test_population.py": "unit/steps",
    "test_state.py": "unit/steps",
    "test_optim.py": "unit/optim",
    "test_autotune.py": "unit/train",
    "test_compile_discipline.py": "unit/compile",
    "test_compile_report.py": "unit/compile",
    "test_compile_scenarios.py": "unit/compile",
    "test_explain.py": "unit/compile",
    "test_fingerprint.py": "unit/compile",
    "test_fingerprint_reach.py": "unit/compile",
    "test_memory_plan.py": "unit/compile",
    "test_early_stop.py": "unit/run",
    "test_lr_find.py": "unit/train",
    "test_readback.py": "unit/train",
    "test_train.py": "unit/train",
    "test_data.py": "unit/data",
    "test_data_failures.py": "unit/data",
    "test_data_on_device.py": "unit/data",
    "test_data_sources.py": "unit/data",
    "test_waits.py": "unit/data",
    "test_checkpoint.py": "unit/checkpoint",
    "test_checkpoint_async.py": "unit/checkpoint",
    "test_checkpoint_files.py": "unit/checkpoint",
    "test_runlock.py": "unit/checkpoint",
    "test_shards.py": "unit/checkpoint",
    "test_sharding.py": "unit/dist",
    "test_devices.py": "unit/dist",
    "test_process_layout.py": "unit/dist",
    "test_curves.py": "unit/observe",
    "test_display.py": "unit/observe",
    "test_oom.py": "unit/train",
    "test_observe_time.py": "unit/observe",
    "test_introspect.py": "unit/train",
    "test_jsonl_logger.py": "unit/observe",
    "test_loggers.py": "unit/observe",
    "test_metrics_logging.py": "unit/observe",
    "test_render.py": "unit/train",
    "test_export.py": "unit/export",
    "test_export_loading.py": "unit/export",
    "test_export_provenance.py": "unit/export",
    "test_serve.py": "unit/serve",
    "test_serve_limits.py": "unit/serve",
    "test_serve_repository.py": "unit/serve",
    "test_export_cli_line.py": "unit/cli",
    "test_import_graph.py": "unit",
    "test_layout.py": "unit",
    "test_public_surface.py": "unit",
    "test_docs.py": "unit",
    "test_doc_paths.py": "unit",  # every repository path the docs name exists
    "test_docstrings.py": "unit",  # public functions document Args/Returns
    "test_skips.py": "unit",
    "test_resume_record.py": "unit/run",
    "test_checkpoint_commit.py": "unit/checkpoint",
    "test_typed_spine.py": "unit",
    "test_manifests.py": "unit",  # Kubernetes and KServe manifests (deploy/, examples/)
    "test_tiers.py": "unit",
    "test_cli.py": "e2e",
    "test_crash_safety.py": "e2e",
    "test_multi_device.py": "e2e",
    "test_multiprocess.py": "e2e",
    "test_cluster_envs.py": "e2e",
    "test_slurm.py": "e2e",
    "test_container.py": "e2e",
    "test_multiprocess_data.py": "e2e",
    "test_multiprocess_peers.py": "e2e",
    "test_notebook.py": "e2e",
    "test_warm_start.py": "e2e",
    "test_mcp.py": "e2e",
    "test_mcp_security.py": "e2e",
    "test_cli_config.py": "e2e",
    # scripts the e2e tests start as rank processes
    "multiprocess_rank.py": "e2e",
    "multiprocess_data_rank.py": "e2e",
}

# Files that stay at tests/ top level.
TOP_LEVEL = {"conftest.py", "README.md"}

_E2E = re.compile(r"jaxnitro launch|\"launch\"|jax\.distributed|nbclient|multi_device")
_IMPORT = re.compile(r"^\s*(?:from|import) jaxnitro\._src\.(\w+)", re.MULTILINE)


def place(path: Path) -> str:
    """The folder under tests/ that `path` belongs in."""
    if path.name in PLACES:
        return PLACES[path.name]
    text = path.read_text(encoding="utf-8", errors="replace")
    if _E2E.search(text):
        return "e2e"
    counts = collections.Counter(m for m in _IMPORT.findall(text) if m in AREAS)
    if counts:
        return "unit/" + counts.most_common(1)[0][0]
    stem = path.stem.removeprefix("test_")
    for area in AREAS:
        if stem.startswith(area):
            return "unit/" + area
    return "unit/train"


def misplaced(tests: Path = TESTS) -> list[tuple[Path, str]]:
    """Files at tests/ top level that belong elsewhere, with the folder each belongs in."""
    out = []
    for path in sorted(tests.iterdir()):
        if path.is_file() and path.suffix == ".py" and path.name not in TOP_LEVEL:
            out.append((path, place(path)))
    return out


def file_relative_paths(path: Path) -> list[str]:
    """Lines of `path` that build paths from `__file__` (they move with the file)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [
        f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if "__file__" in line
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apply", action="store_true", help="git mv the files")
    args = parser.parse_args(argv)
    moves = misplaced()
    if not moves:
        print("every test file is in its area")
        return 0
    for path, folder in moves:
        target = TESTS / folder / path.name
        print(f"{path.relative_to(ROOT)} -> {target.relative_to(ROOT)}")
        for line in file_relative_paths(path):
            print(f"    check after the move: {line}")
        if args.apply:
            target.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", str(path), str(target)], check=True, cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
