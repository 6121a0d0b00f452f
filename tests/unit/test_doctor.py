"""make doctor's comparisons, from what the nodes of a healthy emulated cluster answered
(recorded/doctor_emulated.json), changed the way the faults no container can show would change it:
a clock apart, time sync off, a driver library upgraded under the loaded kernel module, NVML
failing, GPUs missing. The faults containers can show are injected for real in the emulated tier."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlcluster import doctor, doctor_probe, record

RECORDED = json.loads((Path(__file__).parent / "recorded/doctor_emulated.json").read_text())
REPO = Path(__file__).resolve().parents[2]


def setup(gpus: int = 0):
    rec = record.ClusterRecord.model_validate(RECORDED["record"])
    answers = copy.deepcopy(RECORDED["nodes"])
    ray_nodes = copy.deepcopy(RECORDED["ray_nodes"])
    if gpus:  # node-3 as a GPU server, answering as a healthy one does
        rec.nodes[2].gpus = gpus
        for r in ray_nodes:
            if r["node_ip"] == rec.nodes[2].ip:
                r["resources_total"]["GPU"] = float(gpus)
        answers["node-3"]["gpu"] = {
            "module": "580.95.05", "library": "580.95.05",
            "nvml": {"rc": 0, "out": "\n".join(f"{i}, NVIDIA H100 80GB HBM3" for i in range(gpus))},
            "container": {"rc": 0, "out": "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5e1c...)"}}
    clocks = {k: doctor.Clock(**v) for k, v in RECORDED["clocks"].items()}
    return rec, answers, ray_nodes, clocks


def lines(rec, answers, ray_nodes, clocks, **kw) -> list[str]:
    """The findings on the answers as the doctor reads them (each checked against its typed shape)."""
    typed = {name: doctor.Answer.model_validate(a) for name, a in answers.items()}
    return [f.line() for f in doctor.examine(rec, typed, ray_nodes, clocks, **kw)]


def test_the_recorded_answers_read_whole_and_a_drifted_one_is_one_finding():
    """The answers a real cluster gave fit the typed answer field for field (a key the probe
    added and the doctor does not know fails to read); one that does not is a finding, not a crash."""
    rec, answers, ray_nodes, clocks = setup(gpus=2)
    for name, a in answers.items():
        assert doctor.Answer.model_validate(a).model_dump(exclude_unset=True) == a, name
    answers["node-2"]["firewall"]["zone"] = "public"  # a probe newer than this doctor
    assert doctor.Answer.read(answers["node-2"]).error.startswith(
        "an answer the doctor cannot read (1 problem(s), first: firewall.zone: Extra inputs")
    typed = {name: doctor.Answer.read(a) for name, a in answers.items()}
    found = [f.line() for f in doctor.examine(rec, typed, ray_nodes, clocks)]
    assert found == ["node-2: no answer through the bastion (an answer the doctor cannot read (1 "
                     "problem(s), first: firewall.zone: Extra inputs are not permitted)): check the "
                     f"machine is up and reachable: ssh -F {rec.ssh_config} node-2"]


def test_the_recorded_healthy_cluster_has_no_finding():
    assert lines(*setup()) == []
    assert lines(*setup(gpus=1)) == []


def test_clocks_apart_by_more_than_a_second_beyond_the_measurement_error():
    rec, answers, ray_nodes, clocks = setup()
    clocks["node-2"] = doctor.Clock(offset=3.2, uncertainty=0.02)
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-2: its clock is 3.2 s from the head's (more than 1.0 s): enable time sync on every "
        "node (chrony or systemd-timesyncd)"]
    # 1.3 s apart, but measured over a slow link (± 0.2 s each): not proven apart
    clocks["node-2"] = doctor.Clock(offset=1.3, uncertainty=0.2)
    clocks["node-1"] = doctor.Clock(offset=0.0, uncertainty=0.2)
    assert lines(rec, answers, ray_nodes, clocks) == []


def test_time_sync_off_is_named_on_a_server_not_in_a_container():
    rec, answers, ray_nodes, clocks = setup()
    answers["node-2"]["clock"] = {"container": None, "synchronized": "no"}
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-2: its clock is not synchronised (timedatectl: NTPSynchronized=no): enable time sync "
        "(sudo apt install chrony, or systemd-timesyncd)"]
    answers["node-2"]["clock"] = {"container": None, "synchronized": "yes"}
    assert lines(rec, answers, ray_nodes, clocks) == []


def test_a_driver_upgraded_under_the_loaded_module():
    rec, answers, ray_nodes, clocks = setup(gpus=1)
    # what nvidia-smi prints (exit 18) after unattended-upgrades replaced the driver's libraries
    answers["node-3"]["gpu"].update(library="580.105.08", nvml={
        "rc": 18, "out": "Failed to initialize NVML: Driver/library version mismatch\n"
                         "NVML library version: 580.105"})
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-3: the driver library is 580.105.08 but the loaded kernel module is 580.95.05 "
        "(upgraded under the running module): drain the node (make doctor QUARANTINE=1 when it "
        "exists) and reboot it; hold the driver packages against unattended upgrades",
        "node-3: nvidia-smi fails (exit 18): Failed to initialize NVML: Driver/library version "
        "mismatch: reboot the node; if it "
        "persists, reinstall the driver (make cluster-up)"]


def test_no_module_loaded_missing_gpus_and_a_gpu_container_that_does_not_start():
    rec, answers, ray_nodes, clocks = setup(gpus=2)
    answers["node-3"]["gpu"]["module"] = None
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-3: no NVIDIA kernel module is loaded: reboot the node after the driver install (or "
        "sudo modprobe nvidia)"]
    rec, answers, ray_nodes, clocks = setup(gpus=2)
    answers["node-3"]["gpu"]["nvml"]["out"] = "0, NVIDIA H100 80GB HBM3"
    answers["node-3"]["gpu"]["container"] = {
        "rc": 125, "out": "docker: Error response from daemon: could not select device driver \"\" "
                          "with capabilities: [[gpu]]."}
    found = lines(rec, answers, ray_nodes, clocks)
    assert found[0] == ("node-3: nvidia-smi lists 1 GPUs, the cluster record 2: check the GPUs "
                        "(nvidia-smi -q) or set ray_num_gpus in the inventory")
    assert found[1].startswith("node-3: a GPU container does not start (docker: Error response")
    assert len(found) == 2


@pytest.mark.parametrize("text", [
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 09:41:04 UTC 2025\n"
    "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)",
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
    "(dvs-builder@U16-I3-B13-4-3)  Tue Sep 23 09:41:04 UTC 2025"])
def test_the_loaded_modules_version_is_read_from_proc(text):
    assert doctor_probe.module_version(text) == "580.95.05"
    assert doctor_probe.module_version("") is None


def test_versions_python_minor_and_the_image():
    rec, answers, ray_nodes, clocks = setup()
    answers["node-2"]["versions"]["python"] = "3.11.9"  # patch level: Ray's match level is minor
    assert lines(rec, answers, ray_nodes, clocks) == []
    answers["node-2"]["versions"].update(python="3.12.3", horovod=None)
    answers["node-3"]["versions"]["torch"] = "2.13.0"
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-2: Python 3.12.3, the head runs 3.11.2 (Ray needs the same minor version): run make "
        "cluster-up again (it installs the lock's versions everywhere)",
        f"node-2: horovod missing, the head runs {RECORDED['nodes']['node-1']['versions']['horovod']}: "
        "run make cluster-up again (it installs the "
        "lock's versions everywhere)",
        "node-3: torch 2.13.0, the head runs 2.14.1: run make cluster-up again (it installs the "
        "lock's versions everywhere)"]


def test_one_nodes_findings_alone_its_image_not_compared_with_the_others():
    """make upgrade's check (doctor --node): a second docker node still on the old image is not a
    finding of the node just upgraded, nor of the check; the node's own problems still are."""
    rec, answers, ray_nodes, clocks = setup()
    four = rec.nodes[2].model_copy(update={"name": "node-4", "ip": "172.31.251.14"})
    rec.nodes.append(four)
    answers["node-4"] = copy.deepcopy(answers["node-3"])
    answers["node-4"]["versions"]["image"] = "sha256:" + "0" * 64  # not yet upgraded
    for r in ray_nodes:
        if r["node_ip"] == rec.nodes[2].ip:
            ray_nodes.append({**copy.deepcopy(r), "node_ip": four.ip})
    whole = lines(rec, answers, ray_nodes, clocks)
    assert len(whole) == 1 and whole[0].startswith("node-4: Ray runs image sha256:00000000"), whole
    assert lines(rec, answers, ray_nodes, clocks, only="node-4") == []
    assert lines(rec, answers, ray_nodes, clocks, only="node-3") == []
    answers["node-4"]["versions"]["torch"] = "2.13.0"
    answers["node-3"]["service"] = "failed"
    assert [x.split(":")[0] for x in lines(rec, answers, ray_nodes, clocks, only="node-4")] == ["node-4"]
    assert lines(rec, answers, ray_nodes, clocks, only="node-3") == [
        "node-3: Ray's service dlc-ray is failed: sudo systemctl restart dlc-ray on node-3 "
        "(journalctl -u dlc-ray says why it stopped)"]


def test_network_and_resources():
    rec, answers, ray_nodes, clocks = setup()
    answers["node-2"]["interface"]["mtu"] = 9000
    ray_nodes[0]["resources_total"]["CPU"] = 1.0  # node-3 started with fewer CPUs than recorded
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-2: MTU 9000 on eth0, the head's private interface has 1500: set the same MTU on every "
        "node's private interface (a mismatch stalls large all-reduce messages)",
        "node-3: Ray offers 1 CPUs and 0 GPUs, the cluster record 2 and 0: run make cluster-up "
        "again (it restarts Ray with the inventory's resources)"]
    answers["node-2"]["interface"] = None
    assert lines(rec, answers, ray_nodes, clocks)[0] == (
        "node-2: no interface holds its private address 172.31.251.12: fix the node's network or "
        "its `ip` in the inventory, then make cluster-up")


def test_a_node_that_does_not_answer_and_free_space():
    rec, answers, ray_nodes, clocks = setup()
    answers["node-2"] = {"error": "exit 255: ssh: connect to host 172.31.251.12 port 22: No route to host"}
    answers["node-3"]["free"]["docker"] = int(1.5e9)
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-2: no answer through the bastion (exit 255: ssh: connect to host 172.31.251.12 port "
        f"22: No route to host): check the machine is up and reachable: ssh -F {rec.ssh_config} node-2",
        "node-3: 1.5 GB free under Docker data root, below 2.0 GB: free space there (docker image "
        "prune, old Ray logs under its temp dir)"]


def test_a_local_cluster_is_one_line(tmp_path):
    local = {**RECORDED["record"], "kind": "local", "name": "local", "ssh_config": None, "bastion": None}
    (tmp_path / record.RECORD).write_text(json.dumps(local))
    proc = subprocess.run([sys.executable, "-m", "dlcluster", "doctor"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "DLC_CONFIG": str(tmp_path)}, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("doctor: error: the current cluster 'local' is a local one: make doctor "
                           "checks servers brought up from an inventory (make cluster-up INVENTORY=...)\n")


def test_a_quarantined_node_is_one_line_and_the_head_is_never_quarantined():
    rec, answers, ray_nodes, clocks = setup()
    answers["node-2"].update(quarantine="make doctor at 2026-11-25T04:30:00Z: MTU 9000 on eth0",
                             service="inactive", raylet=False)
    ray_nodes = [r for r in ray_nodes if r["node_ip"] != "172.31.251.12"]
    assert lines(rec, answers, ray_nodes, clocks) == [
        "node-2: quarantined (make doctor at 2026-11-25T04:30:00Z: MTU 9000 on eth0): Ray stays down "
        "there: once it is fixed: make unquarantine NODE=node-2"]
    found = [doctor.Finding(node="node-1", what="its clock is not synchronised", fix="...")]
    report = {"nodes": answers, "ray_nodes": ray_nodes}
    assert doctor.quarantine(rec, found, report) == [  # asks no node: nothing to write
        "node-1: not quarantined: the head runs Ray's GCS and every job's driver; fix what is "
        "named above and run make doctor again"]


def test_a_tls_certificate_not_the_cas_not_for_the_node_or_ending():
    rec, answers, ray_nodes, clocks = setup()
    fix = ("run make cluster-up again (it makes the node a certificate of the head's CA and restarts "
           "Ray there when no job runs)")
    answers["node-1"]["tls"]["days_left"] = 12.4
    answers["node-2"]["tls"].update(verified=False,
                                    problem="error 18 at 0 depth lookup: self-signed certificate")
    answers["node-3"]["tls"]["for_address"] = False
    assert lines(rec, answers, ray_nodes, clocks) == [
        f"node-1: Ray's TLS certificate ends in 12 days: {fix}",
        f"node-2: Ray's TLS certificate is not the cluster CA's (error 18 at 0 depth lookup: "
        f"self-signed certificate): {fix}",
        f"node-3: Ray's TLS certificate is not for its private address 172.31.251.13: {fix}"]
    assert lines(rec, answers, ray_nodes, clocks, min_cert_days=10) == lines(rec, answers, ray_nodes,
                                                                               clocks)[1:]
    answers["node-1"]["tls"] = None  # ray_tls: false
    assert lines(rec, answers, ray_nodes, clocks)[0].startswith("node-2: ")


def test_the_probe_reads_a_real_certificate(tmp_path):
    """The node's side: openssl's own answers about a CA and certificates made here as roles/ray's
    tls.yml makes them."""
    def ssl(*args: str, stdin: str | None = None) -> str:
        return subprocess.run(["openssl", *args], cwd=tmp_path, input=stdin, capture_output=True, text=True,
                              check=True).stdout
    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "10",
        "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.crt")
    ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "node.key")
    csr = ssl("req", "-new", "-key", "node.key", "-subj", "/CN=node-2")
    (tmp_path / "ext").write_text("subjectAltName=IP:10.0.0.12,IP:127.0.0.1\n")
    (tmp_path / "node.crt").write_text(ssl("x509", "-req", "-CA", "ca.crt", "-CAkey", "ca.key", "-days", "5",
                                           "-extfile", "ext", stdin=csr))
    settings = {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(tmp_path / "node.crt"),
                "RAY_TLS_CA_CERT": str(tmp_path / "ca.crt")}
    found = doctor_probe.tls(settings, "10.0.0.12")
    assert found["verified"] and found["for_address"] and 4.9 < found["days_left"] <= 5, found
    assert doctor_probe.tls(settings, "10.0.0.1")["for_address"] is False  # a prefix of .12
    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "10",
        "-subj", "/CN=other", "-keyout", "other.key", "-out", "other.crt")
    other = doctor_probe.tls({**settings, "RAY_TLS_SERVER_CERT": str(tmp_path / "other.crt")}, "10.0.0.12")
    assert not other["verified"] and "self-signed" in other["problem"], other
    assert doctor_probe.tls({}, "10.0.0.12") is None
