"""Device set-up: the compilation cache directory is checked before it is trusted."""

from __future__ import annotations

import os
import stat

import pytest

from jaxnitro._src.dist.devices import check_cache_trust


def test_a_shared_compilation_cache_dir_warns(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert check_cache_trust(str(private)) == []
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.warns(UserWarning, match=r"is not used: it is world-writable.*chmod 700"):
        assert check_cache_trust(str(shared)) == ["it is world-writable"]
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, stat.S_IRWXU | stat.S_IRWXG)
    with pytest.warns(UserWarning, match="group-writable"):
        check_cache_trust(str(group))
    assert check_cache_trust(str(tmp_path / "not-yet")) == []  # created private later
