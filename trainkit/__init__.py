"""The training harness every job shares (see job.py): flags, launchers, worker plan,
checkpoints and restore, per-phase timing, ONNX publishing; and the jobs' data sets.

`python jobs/<job>.py`, torchrun and horovodrun find this package through `jobs/trainkit`, a link
to it (a script's own folder is on Python's path); Ray's workers find it in the uploaded
working dir, whose root is on their path.
"""

import time as _time

# when this process reached the harness (Python started, the job file began importing): the
# manifest's timeline starts here
IMPORTED_AT = _time.time()
