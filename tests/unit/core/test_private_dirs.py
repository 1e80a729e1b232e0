"""Directories only this user controls: owners, write bits and links on the whole path.

Ownership by another user needs root (`os.chown`); those cases skip otherwise.
"""

from __future__ import annotations

import os
import stat

import pytest

from jaxnitro._src.core.private_dirs import SUPPORTED, make_private, problems

OTHER = 64123  # a uid no one on this machine has

root_only = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving files to another uid needs root"
)
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="POSIX only")


def whys(path) -> list[str]:
    return [p.why for p in problems(path)]


def test_what_is_made_is_private_whatever_the_umask(tmp_path):
    assert whys(tmp_path / "a" / "b" / "c") == []  # not there yet: checked as far as it is
    old = os.umask(0)
    try:
        assert make_private(tmp_path / "a" / "b" / "c") == []
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700


def test_a_writable_component_on_the_way_is_named(tmp_path):
    shared = tmp_path / "shared"
    (shared / "xla").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)
    assert whys(shared / "xla") == [
        f"{shared} is world-writable, so others can replace what is inside it"
    ]
    assert problems(shared / "xla")[0].fix == f"chmod go-w {shared}"
    shared.chmod(0o1777)  # sticky, like /tmp: others cannot rename what is ours
    assert whys(shared / "xla") == []
    shared.chmod(0o775)
    assert "group-writable" in whys(shared / "xla")[0]


def test_the_cache_directory_itself_is_private(tmp_path):
    (tmp_path / "xla").mkdir(mode=0o700)
    (tmp_path / "xla").chmod(0o1777)  # sticky does not excuse the cache itself
    assert whys(tmp_path / "xla") == ["it is world-writable"]
    assert problems(tmp_path / "xla")[0].fix == f"chmod 700 {tmp_path / 'xla'}"


def test_links_are_followed_only_when_this_user_made_them(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert whys(tmp_path / "link") == []
    (tmp_path / "rel").symlink_to("real/../real")
    assert whys(tmp_path / "rel") == []
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    (tmp_path / "to-open").symlink_to(open_dir)
    assert whys(tmp_path / "to-open") == ["it is world-writable"]  # the target is checked
    (tmp_path / "file").write_text("x")
    assert whys(tmp_path / "file" / "xla") == [f"{tmp_path / 'file'} is not a directory"]


@root_only
def test_what_another_user_owns_on_the_way_is_refused(tmp_path):
    share = tmp_path / "share"
    (share / "xla").mkdir(parents=True, mode=0o700)
    os.chown(share, OTHER, OTHER)  # like /tmp/share of the issue: its owner can swap xla
    assert whys(share / "xla") == [
        f"{share} is owned by another user (uid {OTHER}), who can replace what is inside it"
    ]
    os.chown(share, 0, 0)
    (tmp_path / "link").symlink_to(share / "xla")
    os.lchown(tmp_path / "link", OTHER, OTHER)
    assert whys(tmp_path / "link") == [
        f"{tmp_path / 'link'} is a symbolic link another user (uid {OTHER}) made"
    ]
    os.chown(share / "xla", OTHER, OTHER)
    assert whys(share / "xla") == [f"it is owned by another user (uid {OTHER})"]


def test_a_user_private_group_may_write_on_the_way(tmp_path, monkeypatch):
    import grp
    import pwd
    from types import SimpleNamespace

    from jaxnitro._src.core import private_dirs

    members = {1000: ("ann", ["bob"]), 50: ("staff", [])}
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(os, "getgid", lambda: 1000)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: SimpleNamespace(pw_name="ann"))
    monkeypatch.setattr(
        grp,
        "getgrgid",
        lambda gid: SimpleNamespace(gr_name=members[gid][0], gr_mem=members[gid][1]),
    )
    private_dirs._own_group.cache_clear()
    try:
        assert not private_dirs._own_group(1000)  # bob is in ann's group
        members[1000] = ("ann", [])
        private_dirs._own_group.cache_clear()
        assert private_dirs._own_group(1000)  # ann's own group, umask 002 style
        assert not private_dirs._own_group(50)  # staff: others may be in it
        if os.geteuid() != 0:
            return
        home = tmp_path / "home"
        (home / "xla").mkdir(parents=True, mode=0o700)
        os.chown(home, 1000, 1000)
        os.chown(home / "xla", 1000, 1000)
        home.chmod(0o775)
        assert whys(home / "xla") == []
        os.chown(home, 1000, 50)  # the same bits for a shared group
        assert whys(home / "xla") == [
            f"{home} is group-writable, so others can replace what is inside it"
        ]
    finally:
        private_dirs._own_group.cache_clear()
