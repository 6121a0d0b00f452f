"""make smoke's steps as a pytest suite, run against a live cluster by dlcluster/smoke/run.py
(pytest.main): test_steps.py (the steps), conftest.py (their fixtures). The plugin that prints each
step's line and writes the JSON report, and what the steps share, are dlcluster/smoke/'s."""
