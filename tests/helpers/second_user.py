"""A second local user, for tests of what another user of the machine can do.

Only root can act as another user: the tests that need one skip otherwise, saying why. The
user is a bare uid run through `setpriv` (util-linux): nothing is added to /etc/passwd, and
it owns nothing but what a test makes it own. It runs shell commands (`cp`, `mv`, `ln`), not
Python: the interpreter may sit under a directory only root can enter (`/root/.pyenv`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import pytest

UID = GID = 64123  # not a user of this machine (checked below)


@dataclasses.dataclass(frozen=True)
class OtherUser:
    uid: int
    gid: int

    def sh(self, script: str) -> str:
        """Run `script` with `sh -c` as this user; its stdout (the test fails if it does)."""
        got = subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]
            + ["sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert got.returncode == 0, f"as uid {self.uid}: {script}\n{got.stderr}"
        return got.stdout


def other_user() -> OtherUser:
    """The second user, or skip the test with the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (run the suite as root)")
    if shutil.which("setpriv") is None:
        pytest.skip("acting as a second local user needs setpriv (util-linux)")
    import pwd

    try:
        pwd.getpwuid(UID)
        pytest.skip(f"uid {UID} is a real user of this machine; the tests need an unused one")
    except KeyError:
        pass
    return OtherUser(UID, GID)
