"""`python -m jaxnitro._src.serve DIR [DIR ...]`: the `jaxnitro serve` command on its own.

Exit status: 0 after a clean stop (SIGTERM, Ctrl-C), 1 on a jaxnitro error (a bad bundle,
a port in use), 2 on a usage error."""

from __future__ import annotations

import sys

import click

from jaxnitro._src.core.errors import JaxnitroError
from jaxnitro._src.serve.command import serve_command


def main(argv: list[str] | None = None) -> None:
    try:
        serve_command.main(
            args=argv, prog_name="python -m jaxnitro._src.serve", standalone_mode=False
        )
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None
    except click.Abort:
        raise SystemExit(130) from None
    except JaxnitroError as e:
        print(f"Error: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(0)


if __name__ == "__main__":
    main()
