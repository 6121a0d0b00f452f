"""The operator's package: one command, `dlcluster` (`python -m dlcluster --help`), that every Make
target calls. It runs on the control host; the harness that runs on the nodes is trainkit/, which
never imports it. Importing this package imports nothing: `make setup` may run it before any
virtualenv exists."""
