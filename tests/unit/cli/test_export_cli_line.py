"""The `jaxnitro export` summary's last line, `serve it: jaxnitro serve <path>`, pasted into a
real shell, passes the bundle path as one argument, whatever characters it holds."""

from __future__ import annotations

import subprocess

import pytest

from jaxnitro._src.cli.export import _text


@pytest.mark.parametrize("where", ["my bundles/tiny [v1]", "b*", "it's $HOME", "-x"])
def test_the_serve_line_pastes_into_a_shell_as_one_argument(tmp_path, where):
    (tmp_path / "b1").mkdir()  # a glob "b*" would expand to this, unquoted
    summary = {"bundle": where, "name": "tiny", "platforms": ["cpu"], "inputs": [], "outputs": []}
    line = _text(summary).splitlines()[-1]
    assert line.startswith("serve it: ")
    command = line.removeprefix("serve it: ")
    shell = subprocess.run(
        ["sh", "-c", f"printf '%s\\0' {command}"], cwd=tmp_path, capture_output=True, check=True
    )
    assert shell.stdout.decode().split("\0")[:-1] == ["jaxnitro", "serve", where]
