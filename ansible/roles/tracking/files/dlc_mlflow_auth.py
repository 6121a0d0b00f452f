"""The run history's sign-in: MLflow's own basic auth, and one rule more for every account that is
not an administrator (the jobs' account, `dlc-jobs`, which every node holds for its jobs).

Every job signs in as that one account, so what one job may do, every job may. MLflow lets an
account change its own password and gives the creator of an experiment or model MANAGE on it
(delete, rename, permissions): one job could lock every other out of the run history, or delete
the runs and models the others made. So a request of such an account that changes an account or a
permission, or deletes, renames or restores anything, is refused here (403) before MLflow's own
rules run; logging runs and registering models (default_permission EDIT) go on as before. An
administrator (the operators' account, `make tracking-password`) may do all of it.

roles/tracking installs this file beside the server (root's, read-only) and names it in
mlflow-auth.ini: authorization_function = dlc_mlflow_auth:authenticate.
"""

from __future__ import annotations

import re

from flask import Response, request
from mlflow.server.auth import authenticate_request_basic_auth, store

# MLflow's REST and its web app's routes (/api/2.0/mlflow/..., /ajax-api/2.0/mlflow/...): accounts
# and permissions, deletions (also the artifact store's DELETE), renames, restores, and the
# experiment update that renames one
ADMIN_ONLY = re.compile(r"/(users|permissions)/|/delete|/rename|/restore|/experiments/update$")


def authenticate():
    """MLflow's basic auth (a 401 to sign in); then a 403 for a non-administrator's request that
    only an administrator may make."""
    auth = authenticate_request_basic_auth()
    if isinstance(auth, Response) or not (request.method == "DELETE" or ADMIN_ONLY.search(request.path)):
        return auth
    user = store.get_user(auth.username)
    if user.is_admin:
        return auth
    return Response(f"{auth.username} is not an administrator of the run history: accounts, "
                    f"permissions, deletions and renames are the administrator's (make tracking-password)",
                    status=403, mimetype="text/plain")
