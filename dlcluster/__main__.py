"""python -m dlcluster: the operator's command (dlcluster/cli.py)."""

from dlcluster.cli import main

main()
