"""make smoke's steps as a pytest suite, run against a live cluster by ray/smoke.py (pytest.main):
test_steps.py (the steps), conftest.py (their fixtures), report.py (the plugin that prints each
step's line, writes the JSON report and the summary), lib.py (what they and ray/smoke.py share)."""
