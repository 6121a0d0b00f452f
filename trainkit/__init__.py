"""The training harness every job shares (see job.py): flags, launchers, worker plan,
checkpoints and restore, per-phase timing, ONNX publishing; and the jobs' data sets.

Installed by `make setup` into the checkout's .venv (editable) and into the image (a path entry),
so `python jobs/<job>.py`, torchrun and horovodrun find it; a Ray job's driver and workers import
the copy in its uploaded working dir, which Ray puts first on PYTHONPATH (make smoke checks it).
"""

import time as _time

# when this process reached the harness (Python started, the job file began importing): the
# manifest's timeline starts here
IMPORTED_AT = _time.time()
