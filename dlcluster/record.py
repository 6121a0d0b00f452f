"""The cluster record: the one contract between bringing a cluster up and using it.

Every `make cluster-up` writes `$DLC_CONFIG/clusters/<name>/cluster.json` and makes it the current
cluster (`$DLC_CONFIG/cluster.json`, with `$DLC_CONFIG/ray-client.env` beside it): the local
cluster through `ClusterRecord.write`, the Ansible control role from its template (a unit test
validates that template's output against this model, and the role checks what it wrote with
`python -m dlcluster.record check`). `make submit`, `make smoke`, the benchmark and the test
fixtures find the cluster, its job API and its token only here.

    python -m dlcluster.record show|env|check [FILE]   # the record; its client env; validate
    python -m dlcluster.record token [FILE]            # the cluster's Ray token (the dashboard asks)
    python -m dlcluster.record grafana-password [FILE] # Grafana's admin password (its sign-in page asks)
    python -m dlcluster.record tracking-password [FILE] # the run history's URL, user and password
    python -m dlcluster.record schema                   # its JSON Schema
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainkit.errors import EXIT_USER_ERROR, UserError
from trainkit.flags import config_dir

FORMAT: Final = "dlcluster-cluster/2"
RECORD = "cluster.json"
CLIENT_ENV = "ray-client.env"
# Folders no upload carries. For `ray job submit` .gitignore and .rayignore name them (Ray's own
# default list, which also drops .git, is off: .rayignore keeps .git's refs only, no config, no
# history, from which a job's manifest names the commit); uploads made in code list them.
EXCLUDES = (".venv", ".venv-ansible", "venv", "__pycache__")


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="unique; for a remote cluster its Host in ssh_config")
    ip: str | None = Field(description="the address Ray reports for the node; null on the local "
                                       "cluster, whose nodes all show the host's address")
    role: Literal["head", "worker"]
    cpus: int = Field(ge=0, description="CPUs Ray offers on the node")
    gpus: int = Field(ge=0, description="GPUs Ray offers on the node")
    runtime: Literal["host", "docker"] | None = Field(
        default=None, description="how Ray runs on this node: in the project's image (docker) or in a "
                          "Python environment on the node (host); null on the local cluster")

    @field_validator("ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        if v is not None:
            ipaddress.ip_address(v)
        return v


class ClusterRecord(BaseModel):
    """What a client needs to know about a running cluster."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["dlcluster-cluster/2"] = Field(default=FORMAT, description="this record's format")
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$",
                      description='"local" for the embedded cluster, else the inventory folder\'s name')
    kind: Literal["local", "ansible"]
    job_api: str = Field(description="http://HOST:PORT where this client reaches Ray's job API "
                                     "(for a remote cluster: the local end of the ssh tunnel)")
    metrics_url: str | None = Field(
        default=None,
        description="http://HOST:PORT where this client reaches the cluster's Prometheus (the tunnel's local"
                    " end); null where the cluster has none")
    grafana_url: str | None = Field(
        default=None,
        description="http://HOST:PORT where this client reaches the cluster's Grafana (the tunnel's local "
                    "end); null where the cluster has none")
    grafana_password_path: str | None = Field(
        default=None,
        description="absolute path of Grafana's admin password on this client")
    tracking_url: str | None = Field(
        default=None,
        description="http://HOST:PORT where this client reaches the cluster's MLflow tracking server (the "
                    "tunnel's local end); null where the cluster has none")
    tracking_auth_path: str | None = Field(
        default=None,
        description="absolute path of the tracking server's credentials (user:password, 0600) on this client")
    token_path: str = Field(description="absolute path of the Ray token file on this client")
    nodes: list[Node] = Field(min_length=1, description="the nodes, exactly one of them the head")
    ssh_config: str | None = Field(
        default=None,
        description="ssh config whose node entries ProxyJump through the bastion (set with bastion)")
    bastion: str | None = Field(default=None, description="the bastion's Host in ssh_config")
    storage: str | None = Field(default=None, description="shared storage path on the nodes")
    inventory: str | None = Field(default=None, description="the Ansible inventory it was provisioned from")

    @field_validator("job_api", "metrics_url", "grafana_url", "tracking_url")
    @classmethod
    def _api(cls, v: str | None) -> str | None:
        if v is None:
            return v
        u = urlparse(v)
        try:
            port = u.port
        except ValueError:
            port = None
        if u.username is not None or u.password is not None:  # never echoed
            raise ValueError(f"holds credentials ({u.scheme}://***@{u.hostname}:{port}): give "
                             "http(s)://HOST:PORT alone (credentials live in their files, 0600)")
        if u.scheme not in ("http", "https") or not u.hostname or not port:
            raise ValueError(f"must look like http://HOST:PORT, not {v!r}")
        return v

    @field_validator("token_path", "ssh_config", "grafana_password_path", "tracking_auth_path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_absolute():
            raise ValueError(f"must be an absolute path, not {v!r}")
        return v

    @model_validator(mode="after")
    def _whole(self) -> ClusterRecord:
        if (self.ssh_config is None) != (self.bastion is None):
            raise ValueError("ssh_config and bastion are set together (or both null)")
        names = Counter(n.name for n in self.nodes)
        ips = Counter(n.ip for n in self.nodes if n.ip)
        twice = [f"node name {k!r}" for k, c in names.items() if c > 1] + \
                [f"ip {k}" for k, c in ips.items() if c > 1]
        if twice:
            raise ValueError(f"{', '.join(twice)} appear(s) more than once")
        heads = sum(n.role == "head" for n in self.nodes)
        if heads != 1:
            raise ValueError(f"exactly one node has role head, found {heads}")
        return self

    # ---- what a client does with it
    def client_env(self) -> dict[str, str]:
        """The environment `ray job submit` needs: the job API, token auth, the excludes."""
        return {"RAY_ADDRESS": self.job_api, "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": self.token_path,
                # What the upload leaves behind is .gitignore's and .rayignore's to say (Ray reads
                # both; they name EXCLUDES). Ray's own default list would only add a warning per
                # folder on every submit that it now leaves .venv behind.
                "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES": "",
                # `ray job submit` at warning: the CLI's default level (its --logging-level) also
                # prints a notice per ignore file it reads; the submission, the job's own log and
                # its result (Ray's CLI logger) are printed at any level.
                "RAY_LOGGER_LEVEL": "warning"}

    def runtime_env(self, commit: str | None) -> dict:
        """What `make submit` gives a job's runtime env: the checkout's commit (data: the upload
        carries no history) and where this operator's browser reaches the run history (the links
        the run prints; the nodes' address is their own DLC_TRACKING_URL)."""
        env = {"DLC_SUBMIT_COMMIT": commit} if commit else {}
        if self.tracking_url:
            env["DLC_TRACKING_PAGE_URL"] = self.tracking_url
        return {"env_vars": env}

    def client_env_text(self) -> str:
        """ray-client.env: `export KEY=VALUE` lines, each value quoted for the shell (`source` it);
        dlcluster submit reads the record itself."""
        return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.client_env().items())

    def write(self, config: Path | None = None) -> Path:
        """Write the record and its client env under clusters/<name>/ and make it current."""
        config = config or config_dir()
        folder = config / "clusters" / self.name
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        text = self.model_dump_json(indent=2) + "\n"
        env = self.client_env_text()
        for where in (folder, config):
            _write(where / RECORD, text)
            _write(where / CLIENT_ENV, env)
        return folder / RECORD


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def problems(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}"
                     for e in error.errors(include_url=False))


def load(path: Path | None = None) -> ClusterRecord:
    """The current cluster's record (or `path`); a missing, truncated or foreign one is one line."""
    path = path or config_dir() / RECORD
    if not path.is_file():
        raise UserError(f"no cluster record at {path}: no cluster is up from here; run make "
                        "cluster-up first")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read the cluster record {path} ({e}); rerun make cluster-up to "
                        "rewrite it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path} is not a dlcluster cluster record (no \"format\": \"{FORMAT}\"); "
                        "rerun make cluster-up to rewrite it")
    try:
        return ClusterRecord.model_validate(data)
    except ValidationError as e:
        raise UserError(f"bad cluster record {path}: {problems(e)}; rerun make cluster-up to "
                        "rewrite it") from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    what, path = (argv + ["show"])[0], (Path(argv[1]) if len(argv) > 1 else None)
    try:
        if what == "schema":
            print(json.dumps(ClusterRecord.model_json_schema(), indent=2))
        elif what == "show":
            print(load(path).model_dump_json(indent=2))
        elif what == "env":
            print(load(path).client_env_text(), end="")
        elif what == "token":
            # for pasting into the dashboard's sign-in dialog: to this terminal only, never a log
            token = Path(load(path).token_path)
            if not token.is_file():
                raise UserError(f"no token at {token}: make cluster-up (or make attach) writes it")
            print(token.read_text().strip())
        elif what == "grafana-password":
            # for Grafana's sign-in page (user admin): to this terminal only, never a log
            r = load(path)
            if r.grafana_url is None or r.grafana_password_path is None:
                raise UserError(f"cluster {r.name} has no Grafana: make cluster-up installs it on the head "
                                "where Grafana's package source is reachable (dlc_grafana)")
            secret = Path(r.grafana_password_path)
            if not secret.is_file():
                raise UserError(f"no Grafana password at {secret}: make cluster-up fetches it from the head")
            print(secret.read_text().strip())
        elif what == "tracking-password":
            # for the run history's sign-in (MLflow's basic auth): to this terminal only, never a log
            r = load(path)
            if r.tracking_url is None or r.tracking_auth_path is None:
                raise UserError(f"cluster {r.name} has no tracking server: make cluster-up starts one")
            auth = Path(r.tracking_auth_path)
            if not auth.is_file():
                raise UserError(f"no run history credentials at {auth}: make cluster-up (or make attach) "
                                "fetches them from the head")
            user, _, password = auth.read_text().strip().partition(":")
            print(f"{r.tracking_url}  user {user}  password {password}")
        elif what == "check":
            r = load(path)
            print(f"{path or config_dir() / RECORD}: cluster {r.name} ({r.kind}, {len(r.nodes)} "
                  f"node(s)) at {r.job_api}")
        else:
            raise UserError(f"unknown command {what!r}; use show, env, token, "
                            "grafana-password, tracking-password, check or schema")
    except UserError as e:
        print(f"record: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    main()
