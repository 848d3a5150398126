"""`python -m gpuhook`: the same entry point as the `gpuhook` console script."""

from gpuhook.cli import exit_now, main

exit_now(main())
