"""Run deploy/ as written: the etcd StatefulSet's container command for its three members, then the trainer
command of each manifest (Indexed Job, PyTorchJob, Slurm batch script) for two pods/nodes that train
examples/train_ddp.py for a few steps against that etcd.

Each member and each trainer runs in its own network namespace (see ``netlab``), names resolve as the
headless Services make them resolve, and only what a pod would get from its environment is substituted:
downward-API fields (pod name and IP, Job labels), the PyTorchJob operator's PET_* variables, the volume
mount paths (a temporary directory), the step count and the checkpoint URI (a local directory). Without
network namespaces (not root) everything runs on 127.0.0.1 and the etcd names and ports are rewritten to
loopback ports, which the test prints.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd_server import find_etcd_binary
from tests.deploy import manifests as m
from tests.deploy.netlab import NetLab, loopback_reason

# Bounds against hangs, not speed targets: on a quiet 2-core machine each run takes ~15 s, under a load of 14
# (8 test sessions on 2 cores) up to ~110 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6
NODES = 2
ETCD_YAML = m.KUBERNETES / "etcd.yaml"


def _free_port() -> int:
    # Loopback fallback only (bind-release-reuse can race; the health wait below then fails with the logs).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """The lab with a running 3-member etcd made from etcd.yaml."""

    lab: NetLab
    root: Path
    endpoints: str
    """Every member's client endpoint, as a trainer on this lab writes them."""
    rewrite: Callable[[str], str]
    """Identity on isolated hosts; on loopback, member names/ports -> 127.0.0.1 ports."""
    base_env: dict[str, str]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.root.glob("*.log")))


def _base_env(home: Path) -> dict[str, str]:
    bin_dirs = [str(Path(sys.executable).parent), str(Path(find_etcd_binary()).parent), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
    env = {"PATH": os.pathsep.join(bin_dirs), "PYTHONPATH": str(m.REPO), "HOME": str(home), "LANG": "C.UTF-8"}
    if "LOGLEVEL" in os.environ:  # spotrun's log level, to debug a failing run
        env["LOGLEVEL"] = os.environ["LOGLEVEL"]
    return env


def _mount(argv: list[str], container: dict[str, Any], root: Path) -> list[str]:
    """Volume mounts -> directories under ``root`` (each pod has its own volumes)."""
    out = argv
    for mount in container.get("volumeMounts", []):
        target = root / mount["name"]
        target.mkdir(parents=True, exist_ok=True)
        out = [a.replace(mount["mountPath"], str(target)) for a in out]
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("deploy-run")
    reason = loopback_reason()
    if reason is not None:
        print(f"\ndeploy run: no network namespaces ({reason}); every host on 127.0.0.1, etcd names rewritten")
    lab = NetLab(isolated=reason is None)
    sts = m.find(ETCD_YAML, "StatefulSet")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    members = [f"{name}-{i}" for i in range(sts["spec"]["replicas"])]
    for i, pod in enumerate(members):
        aliases = [f"{pod}.{service}", pod]
        if i == 0:
            aliases.append(f"{name}-client")  # a ClusterIP Service picks a live member; here always member 0
        lab.add(pod, *aliases)
    for i in range(NODES):
        lab.add(f"node-{i}", f"spotrun-train-{i}.spotrun-train", f"spotrun-train-{i}")

    replacements: dict[str, str] = {}
    if not lab.isolated:
        ports = {pod: (_free_port(), _free_port()) for pod in members}
        for pod, (client, peer) in ports.items():
            replacements[f"{pod}.{service}:2379"] = f"127.0.0.1:{client}"
            replacements[f"{pod}.{service}:2380"] = f"127.0.0.1:{peer}"
        replacements[f"{name}-client:2379"] = f"127.0.0.1:{ports[members[0]][0]}"

    def rewrite(text: str) -> str:
        for old, new in replacements.items():
            text = text.replace(old, new)
        return text

    base_env = _base_env(root)
    (container,) = m.pod_template(sts)["spec"]["containers"]
    try:
        lab.start()
        for pod in members:
            env = m.container_env(container, {"metadata.name": pod})
            argv = _mount(m.container_argv(container, env), container, root / pod)
            if not lab.isolated:
                client, peer = ports[pod]
                argv = [rewrite(a).replace("0.0.0.0:2379", f"127.0.0.1:{client}").replace("0.0.0.0:2380", f"127.0.0.1:{peer}")
                        for a in argv]
            with open(root / f"{pod}.log", "wb") as log:
                lab.popen(pod, argv, env={**base_env, **env}, cwd=root, log=log)
        endpoints = rewrite(",".join(f"{pod}.{service}:2379" for pod in members))
        c = Cluster(lab, root, endpoints, rewrite, base_env)
        _wait_healthy(c, len(members))
        yield c
    finally:
        lab.close()


def _wait_healthy(c: Cluster, members: int, timeout: float = 30.0) -> None:
    """Poll (with a deadline) until every member answers from a trainer host and the cluster has a leader."""
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        result = c.lab.run("node-0", [etcdctl, f"--endpoints={c.endpoints}", "endpoint", "status", "-w", "json"],
                           env=c.base_env, timeout=10)
        if result.returncode == 0:
            status = json.loads(result.stdout)
            leaders = {s["Status"]["leader"] for s in status}
            if len(status) == members and len(leaders) == 1 and 0 not in leaders:
                return
        last = result.stdout + result.stderr
        time.sleep(0.2)  # poll with deadline: etcd has no readiness signal we can wait on
    pytest.fail(f"the 3-member etcd from etcd.yaml did not form in {timeout} s: {last}\n{c.logs()}")


def _run_all(c: Cluster, procs: list[tuple[str | None, list[str], dict[str, str]]], label: str,
             timeout: float = 240.0) -> list[str]:
    """Start every (host, argv, env) at once, wait for all; returns their outputs (fails with them on error)."""
    started = []
    for i, (host, argv, env) in enumerate(procs):
        log_path = c.root / f"{label}-{i}.log"
        with open(log_path, "wb") as log:
            started.append((c.lab.popen(host, argv, env=env, cwd=m.REPO, log=log), log_path))
    deadline = time.monotonic() + timeout
    codes = []
    for proc, _ in started:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    outputs = [path.read_text(errors="replace") for _, path in started]
    for proc, _ in started:
        c.lab.stop(proc)
    if codes != [0] * len(codes):
        details = "\n".join(f"--- {label}-{i} exit {code}\n{out[-4000:]}" for i, (code, out) in enumerate(zip(codes, outputs)))
        pytest.fail(f"{label}: exit codes {codes}\n{details}\n{c.logs()}")
    return outputs


def _assert_trained(outputs: list[str], ckpt: Path) -> None:
    """Both nodes trained in one group to STEPS and the last step is committed at that world size."""
    world = NODES * (os.cpu_count() or 1)  # --nproc-per-node=auto on a CPU-only host: one worker per CPU
    assert any(f"step={STEPS} " in out and f"world_size={world}" in out for out in outputs), outputs
    assert (ckpt / "latest").read_text().strip() == f"step-{STEPS:09d}"
    manifest = json.loads((ckpt / f"step-{STEPS:09d}" / "manifest.json").read_text())
    assert manifest["world_size"] == world
    assert (ckpt / f"step-{STEPS:09d}" / ".commit").exists()


def _trainer_container(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = next(d for d in m.documents(path) if d["kind"] in ("Job", "PyTorchJob"))
    (container,) = m.pod_template(doc)["spec"]["containers"]
    return doc, container


def _pod_env(c: Cluster, container: dict[str, Any], fields: dict[str, str], base: dict[str, str],
             overrides: dict[str, str]) -> dict[str, str]:
    env = m.container_env(container, fields, base)
    env.update(overrides)  # the knobs a user edits: steps and checkpoint location
    env = {k: c.rewrite(v) for k, v in env.items()}
    return env


def _indexed_job_pods(c: Cluster, steps: int, ckpt: Path) -> list[tuple[str | None, list[str], dict[str, str]]]:
    """(host, argv, env) of each of job.yaml's pods, one Job (one controller UID) per call."""
    job, container = _trainer_container(m.KUBERNETES / "job.yaml")
    uid = str(uuid.uuid4())
    pods: list[tuple[str | None, list[str], dict[str, str]]] = []
    for i in range(NODES):
        host = c.lab.hosts[f"node-{i}"]
        fields = {"status.podIP": host.addr,
                  "metadata.labels['batch.kubernetes.io/job-name']": job["metadata"]["name"],
                  "metadata.labels['batch.kubernetes.io/controller-uid']": uid}
        base = {"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"{job['metadata']['name']}-{i}"}
        env = _pod_env(c, container, fields, base, {"TRAIN_STEPS": str(steps), "CKPT_URI": str(ckpt)})
        pods.append((f"node-{i}", m.container_argv(container, env), {**c.base_env, **env}))
    return pods


def test_indexed_job_trains_against_the_etcd_cluster(cluster: Cluster) -> None:
    ckpt = cluster.root / "job-ckpt"
    procs = _indexed_job_pods(cluster, STEPS, ckpt)
    # As written: the endpoint list names all three members.
    assert f"--rdzv-endpoint={cluster.endpoints}" in procs[0][1]
    _assert_trained(_run_all(cluster, procs, "job"), ckpt)


def test_pytorchjob_trains_with_the_operators_environment(cluster: Cluster) -> None:
    job, container = _trainer_container(m.KUBERNETES / "pytorchjob.yaml")
    ckpt = cluster.root / "pytorchjob-ckpt"
    name = f"{job['metadata']['generateName']}{uuid.uuid4().hex[:5]}"
    operator_env = m.pytorchjob_env(job)
    assert operator_env["PET_RDZV_BACKEND"] == "etcd-v3"
    procs = []
    for i in range(NODES):
        host = cluster.lab.hosts[f"node-{i}"]
        fields = {"status.podIP": host.addr, "metadata.labels['training.kubeflow.org/job-name']": name}
        env = _pod_env(cluster, container, fields, operator_env, {"TRAIN_STEPS": str(STEPS), "CKPT_URI": str(ckpt)})
        procs.append((f"node-{i}", m.container_argv(container, env), {**cluster.base_env, **env}))
    _assert_trained(_run_all(cluster, procs, "pytorchjob"), ckpt)


def test_slurm_script_trains_one_agent_per_node(cluster: Cluster) -> None:
    ckpt = cluster.root / "slurm-ckpt"
    logs = cluster.root  # the stand-in writes srun-task<i>.log there (shown with the other logs on failure)
    standin = cluster.root / "srun-bin"
    standin.mkdir()
    (standin / "srun").symlink_to(Path(__file__).with_name("srun"))
    hosts = [cluster.lab.hosts[f"node-{i}"] for i in range(NODES)]
    netns = [f"{h.netns}={h.hostname}" if h.netns else "-" for h in hosts]
    env = {**cluster.base_env,
           "PATH": f"{standin}{os.pathsep}{cluster.base_env['PATH']}",
           "ETCD": cluster.endpoints, "CKPT": str(ckpt), "STEPS": str(STEPS), "USER": "test",
           "SLURM_JOB_ID": str(40000 + os.getpid() % 10000), "SLURM_JOB_NUM_NODES": str(NODES),
           "SRUN_NETNS": " ".join(netns), "SRUN_LOG_DIR": str(logs)}
    _run_all(cluster, [(None, ["bash", str(m.SBATCH)], env)], "slurm")
    _assert_trained([p.read_text(errors="replace") for p in sorted(logs.glob("srun-task*.log"))], ckpt)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str, c: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}\n{c.logs()}")
        time.sleep(0.2)  # poll with deadline: no event to wait on across processes we only observe


def test_prestop_hook_gives_the_agent_its_notice(cluster: Cluster) -> None:
    """job.yaml's preStop command, as written, run in the PID namespace of an agent that is PID 1 (as in its
    container) while training: the agent and its workers stop, and its registration leaves etcd."""
    if not cluster.lab.isolated:
        pytest.skip("needs namespaces: the agent must be PID 1 of its own PID namespace, as in a container")
    _, container = _trainer_container(m.KUBERNETES / "job.yaml")
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    ckpt = cluster.root / "prestop-ckpt"
    pods = _indexed_job_pods(cluster, 100_000_000, ckpt)
    uid = m.flag_value(pods[0][1], "--rdzv-id")
    started = []
    for i, (host, argv, env) in enumerate(pods):
        if i == 0:  # the container's PID namespace: the agent is PID 1 (unshare forks it and waits)
            argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
        with open(cluster.root / f"prestop-{i}.log", "wb") as log:
            started.append(cluster.lab.popen(host, argv, env=env, cwd=m.REPO, log=log))
    pod0 = started[0]
    try:
        _wait_for(lambda: (ckpt / "latest").exists(), 240, "the first committed checkpoint", cluster)
        (agent,) = _children(pod0.pid)
        # The kubelet runs the hook inside the container, i.e. in the agent's PID namespace.
        hook_run = subprocess.run(["nsenter", f"--target={agent}", "--pid", "--", *hook],
                                  check=False, capture_output=True, text=True, timeout=120)
        # The hook loops until PID 1 is gone; the namespace's end then takes the hook's shell with it. The agent
        # left after saving with job.yaml's --planned-leave-exit-code (75), which its podFailurePolicy ignores.
        assert pod0.wait(timeout=30) == int(m.flag_value(pods[0][1], "--planned-leave-exit-code") or 0) == 75, hook_run
        assert not os.path.exists(f"/proc/{agent}")
        etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))

        def registered() -> list[str]:
            out = cluster.lab.run("node-1", [etcdctl, f"--endpoints={cluster.endpoints}", "get", "--prefix",
                                             "--keys-only", f"/spotrun/rdzv/{uid}/ctl/nodes/"],
                                  env=cluster.base_env, timeout=10)
            return [k for k in out.stdout.split() if k]

        # Gone at once, not after its lease's TTL (3 s): the agent revoked it when it left on SIGTERM.
        keys = registered()
        assert not any(f"/{cluster.lab.hosts['node-0'].hostname}-" in k for k in keys), keys
        assert any(f"/{cluster.lab.hosts['node-1'].hostname}-" in k for k in keys), keys
    finally:
        for proc in started:
            cluster.lab.stop(proc)
