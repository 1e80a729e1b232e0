"""The repository's `Dockerfile`, read the way Docker reads it: the final stage's
instructions, with `ENTRYPOINT`/`CMD` as their JSON (exec-form) arrays."""

from __future__ import annotations

import json
import re

from helpers.paths import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined."""
    text = DOCKERFILE.read_text() if text is None else text
    joined = re.sub(r"\\\n", " ", text)
    out: list[tuple[str, str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            out = []  # a new stage: only the last one is the image
        out.append((word.upper(), rest.strip()))
    return out


def exec_form(name: str) -> list[str]:
    """The last `name` (ENTRYPOINT or CMD) of the final stage, which must be a JSON array."""
    found = [args for word, args in instructions() if word == name]
    assert found, f"the Dockerfile has no {name}"
    value = json.loads(found[-1])  # the shell form would not parse: it must be exec form
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), value
    return value


def command() -> list[str]:
    """What the container runs: ENTRYPOINT followed by CMD."""
    return exec_form("ENTRYPOINT") + exec_form("CMD")
