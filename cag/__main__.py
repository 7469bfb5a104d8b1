"""`python -m cag` runs the `cag` command line."""

from cag.cli.main import main

main()
