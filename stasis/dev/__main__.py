"""`python -m stasis.dev ...`: the same as `stasis-dev ...`."""

from stasis.dev.cli import main

main()
