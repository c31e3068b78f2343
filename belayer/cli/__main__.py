"""`python -m belayer.cli` runs the same CLI as the `belayer` script."""

from belayer.cli.main import main

main()
