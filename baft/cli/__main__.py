"""``python -m baft.cli``."""

from baft.cli.main import main

main()
