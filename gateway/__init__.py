"""The job gateway: the one door people use to reach a cluster's Ray (its job API and dashboard).

It runs on the head as its own system user (systemd's dlc-gateway; the local cluster starts it
too), takes each person's own credential, forwards what that person may do to Ray with the
cluster's token, and keeps what Ray forgets: who owns each job, an audit trail, each job's record
and driver log. Ray itself has no users; code inside a job still runs as the cluster's account
(docs/security.md says what this protects and what it does not).

    store.py   the head's database (SQLite): people, jobs, their logs' folder, the audit chain
    policy.py  who may do what: the allow-list of Ray's routes, owners, credentials' expiry
    app.py     the HTTP server (aiohttp): sign-in, the allow-list, owners, forwarding to Ray
    keeper.py  each job's record and driver log kept as it runs, beyond Ray's temp folder
"""
