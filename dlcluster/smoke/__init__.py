"""make smoke and make baseline, the operator's side: run.py (flags, the cluster record, pytest.main
on the suite suite/test_steps.py), lib.py (the steps, their time limits, the job
submissions), report.py (the pytest plugin: the lines, the JSON report), protocol.py (what the
job side, ray/smoke_checks.py, and this side share). Importing it imports nothing."""
