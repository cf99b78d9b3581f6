"""``python -m remat``: the command line."""

from remat.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
