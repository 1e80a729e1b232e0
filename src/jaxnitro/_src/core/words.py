"""The words that mean a boolean, wherever text becomes one: a flag's value (`--log-grad-norm
y`, `--resume on`), a field or option in a config file or over MCP, an environment variable.

One vocabulary, so no two places disagree on what `y` or `1` means.
"""

from __future__ import annotations

#: Case-insensitive; surrounding spaces are ignored.
TRUE_WORDS = ("true", "yes", "y", "on", "1")
FALSE_WORDS = ("false", "no", "n", "off", "0")


def bool_word(text: str) -> bool | None:
    """True or False for a word of the vocabulary, None for any other text.

    Example:
        >>> bool_word("Y"), bool_word("off"), bool_word("runs/a")
        (True, False, None)
    """
    low = text.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    return None


def vocabulary() -> str:
    """The words, as an error message lists them: `true/yes/y/on/1 or false/no/n/off/0`."""
    return f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"
