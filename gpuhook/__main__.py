"""`python -m gpuhook`: the same entry point as the `gpuhook` console script."""

from gpuhook.cli import main

raise SystemExit(main())
