"""Two processes on localhost, each reading only its shard of a grain source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import SRC

pytest.importorskip("grain")
HERE = Path(__file__).parent


@pytest.mark.slow
@pytest.mark.multi_device
def test_each_process_reads_only_its_shard(tmp_path):
    cmd = [sys.executable, "-m", "jaxnitro", "launch", "--nproc", "2", "--devices-per-process"]
    cmd += ["2", str(HERE / "multiprocess_data_rank.py"), str(tmp_path), str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": SRC, "JAXNITRO_NO_PLOT": "1"}
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    reads = [set(r["read"]) for r in ranks]
    assert not reads[0] & reads[1] and reads[0] | reads[1] == set(range(256))
    assert [len(r) for r in reads] == [128, 128]
    assert ranks[0]["step"] == ranks[1]["step"] == 8  # 128 rows per process, 16 per batch
