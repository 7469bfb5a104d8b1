"""`python -m cli` runs the `cag` command line."""

from cli.main import main

main()
