"""`python -m jaxnitro ...`: the `jaxnitro` command."""

from jaxnitro._src.cli import main

if __name__ == "__main__":
    main()
