"""Sharded checkpoints: each process's shard hashes, checked when the trees are read back."""

from __future__ import annotations

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro._src.checkpoint import shards as checkpoint_shards
from jaxnitro._src.checkpoint.format import checksum


def test_shard_checksums_catch_a_changed_or_missing_shard(tmp_path):
    value = np.arange(8.0).reshape(2, 4)
    halves = [[[0, 2], [0, 2]], [[0, 2], [2, 4]]]
    shards = [[h, checksum(["['w']"], [value[:, h[1][0] : h[1][1]]])] for h in halves]
    leaf = {"path": "['w']", "shards": shards}
    spec = {"leaves": [leaf], "sha256": checkpoint_shards._tree_hash([leaf])}
    checkpoint_shards.verify(tmp_path, "params", spec, [value])
    changed = value.copy()
    changed[1, 3] = -1
    with pytest.raises(jn.CheckpointError, match="checksum mismatch in tree 'params'"):
        checkpoint_shards.verify(tmp_path, "params", spec, [changed])
    leaf["shards"] = leaf["shards"][:1]  # a shard left out
    spec["sha256"] = checkpoint_shards._tree_hash([leaf])
    with pytest.raises(jn.CheckpointError, match="checksum mismatch"):
        checkpoint_shards.verify(tmp_path, "params", spec, [value])
