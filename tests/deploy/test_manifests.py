"""deploy/ as the cluster sees it: every Kubernetes object validates against the Kubernetes schema
(kubernetes-validate, strict: unknown fields fail), plus the cross-field rules the API server and the
controllers enforce that a JSON schema cannot express, and the wiring between the pieces (names, labels,
ports, grace periods, the image's layout)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from elastic.cli import build_parser
from tests.deploy import manifests as m

#: Oldest Kubernetes the manifests are meant for (backoffLimitPerIndex and podFailurePolicy are on by default
#: from 1.29 and 1.26, the batch.kubernetes.io/ labels exist from 1.27), and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]

CORE_DOCS = [(path, doc) for path, doc in m.all_documents() if doc["kind"] != "PyTorchJob"]

SAMPLE_FIELDS = {
    "metadata.name": "spotrun-train-0-abcde",
    "status.podIP": "10.0.0.7",
    "metadata.labels['batch.kubernetes.io/job-name']": "spotrun-train",
    "metadata.labels['batch.kubernetes.io/controller-uid']": "0f1e2d3c-aaaa-bbbb-cccc-1234567890ab",
    "metadata.labels['training.kubeflow.org/job-name']": "spotrun-train-x7k2p",
}


def _id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}:{doc['metadata'].get('name') or doc['metadata'].get('generateName')}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", CORE_DOCS, ids=[_id(i) for i in CORE_DOCS])
def test_object_validates_against_the_kubernetes_schema(item: tuple[Path, dict[str, Any]], version: str) -> None:
    kubernetes_validate.validate(item[1], version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pytorchjob_pod_template_validates(version: str) -> None:
    """kubernetes-validate has no schema for the PyTorchJob CRD: its Worker pod template is validated as a
    core PodTemplate, and the elasticPolicy against the operator's field list."""
    job = m.find(m.KUBERNETES / "pytorchjob.yaml", "PyTorchJob")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(job, version, strict=True)
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                "template": m.pod_template(job)}
    kubernetes_validate.validate(template, version, strict=True)


def test_schema_validation_catches_what_it_should() -> None:
    """The validator is not vacuous: an unknown field in a Job is an error."""
    job = m.find(m.KUBERNETES / "job.yaml", "Job")
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)


def test_pytorchjob_elastic_policy_uses_etcd_v3() -> None:
    job = m.find(m.KUBERNETES / "pytorchjob.yaml", "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    policy = job["spec"]["elasticPolicy"]
    assert set(policy) <= m.PYTORCHJOB_ELASTIC_FIELDS, set(policy) - m.PYTORCHJOB_ELASTIC_FIELDS
    assert policy["rdzvBackend"] == "etcd-v3"
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] <= policy["maxReplicas"]
    (container,) = m.pod_template(job)["spec"]["containers"]
    assert container["name"] == "pytorch", "the training-operator finds the trainer by this container name"
    # The client Service the operator's PET_RDZV_ENDPOINT points at exists in etcd.yaml, on that port.
    services = {d["metadata"]["name"]: d for d in m.documents(m.KUBERNETES / "etcd.yaml") if d["kind"] == "Service"}
    client = services[policy["rdzvHost"]]
    assert policy["rdzvPort"] in [p["port"] for p in client["spec"]["ports"]]
    assert client["spec"]["selector"] == m.find(m.KUBERNETES / "etcd.yaml", "StatefulSet")["spec"]["selector"]["matchLabels"]


# --- etcd ----------------------------------------------------------------------------------------------------

def _etcd_flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)


def test_etcd_is_a_three_member_cluster_that_can_find_itself() -> None:
    path = m.KUBERNETES / "etcd.yaml"
    sts = m.find(path, "StatefulSet")
    replicas = sts["spec"]["replicas"]
    assert replicas == 3
    headless = [d for d in m.documents(path) if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    assert headless[0]["spec"].get("publishNotReadyAddresses") is True, "members must resolve before they are ready"
    assert sts["spec"].get("podManagementPolicy") == "Parallel"
    (container,) = m.pod_template(sts)["spec"]["containers"]
    assert re.fullmatch(r"\S+:v3\.(5|6)\.\d+", container["image"]), f"etcd image not pinned: {container['image']}"
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    for index in range(replicas):
        pod = f"{name}-{index}"
        env = m.container_env(container, {"metadata.name": pod})
        flags = _etcd_flags(m.container_argv(container, env))
        assert flags["name"] == pod
        cluster = dict(item.split("=", 1) for item in flags["initial-cluster"].split(","))
        assert cluster == {f"{name}-{i}": f"http://{name}-{i}.{svc}:2380" for i in range(replicas)}
        assert flags["initial-advertise-peer-urls"] == cluster[pod]
        assert flags["advertise-client-urls"] == f"http://{pod}.{svc}:2379"
    # The data dir is on the PVC.
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert flags["data-dir"].startswith(mounts[claim] + "/")


def test_etcd_survives_node_loss_and_drains() -> None:
    path = m.KUBERNETES / "etcd.yaml"
    sts = m.find(path, "StatefulSet")
    labels = m.pod_template(sts)["metadata"]["labels"]
    anti = m.pod_template(sts)["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and t["labelSelector"]["matchLabels"].items() <= labels.items()
               for t in anti)
    pdb = m.find(path, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    quorum = sts["spec"]["replicas"] // 2 + 1
    assert pdb["spec"].get("maxUnavailable", sts["spec"]["replicas"] - pdb["spec"].get("minAvailable", 0)) <= sts["spec"]["replicas"] - quorum


# --- trainer -------------------------------------------------------------------------------------------------

def _trainer(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = next(d for d in m.documents(path) if d["kind"] in ("Job", "PyTorchJob"))
    (container,) = m.pod_template(doc)["spec"]["containers"]
    return doc, container


def test_indexed_job_follows_the_api_servers_rules() -> None:
    """What kubectl apply would reject or mis-run, which the schema alone does not see."""
    path = m.KUBERNETES / "job.yaml"
    job, _ = _trainer(path)
    spec, pod = job["spec"], m.pod_template(job)["spec"]
    assert spec["completionMode"] == "Indexed"
    if "backoffLimitPerIndex" in spec or "podFailurePolicy" in spec:
        assert pod["restartPolicy"] == "Never", "backoffLimitPerIndex/podFailurePolicy need restartPolicy: Never"
    if "maxFailedIndexes" in spec:
        assert "backoffLimitPerIndex" in spec and spec["maxFailedIndexes"] <= spec["completions"]
    # A planned leave exits non-zero so the index is recreated, and that exit is not counted as a failure.
    (container,) = m.pod_template(job)["spec"]["containers"]
    argv = m.container_argv(container, m.container_env(container, SAMPLE_FIELDS))
    code = build_parser().parse_args(argv[1:]).planned_leave_exit_code
    assert code, "an agent that left for its notice must not exit 0: the Indexed Job would not recreate its index"
    ignored = [r["onExitCodes"] for r in spec["podFailurePolicy"]["rules"]
               if r["action"] == "Ignore" and "onExitCodes" in r]
    assert [(r["containerName"], r["operator"], r["values"]) for r in ignored] == [(container["name"], "In", [code])]
    # Any agent that exits 0 finished the run: one succeeded index completes the Job (and ends a late pod that
    # would otherwise wait for peers that are gone), and no exit code the policy ignores is 0.
    assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    assert 0 not in [v for r in ignored for v in r["values"]]
    # A headless Service whose selector matches the Job's pods, named like the pods' subdomain.
    service = m.find(path, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    pod_labels = {**m.pod_template(job)["metadata"].get("labels", {}), "batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("name", ["job.yaml", "pytorchjob.yaml"])
def test_trainer_command_parses_and_gives_the_agent_its_notice(name: str) -> None:
    doc, container = _trainer(m.KUBERNETES / name)
    env = m.container_env(container, SAMPLE_FIELDS)
    argv = m.container_argv(container, env)
    assert argv[0] == "spotrun"
    assert not [a for a in argv if "$(" in a], f"unexpanded variables in {argv}"
    args = build_parser().parse_args(argv[1:])  # every flag is one spotrun knows
    assert args.training_script == "examples/train_ddp.py"
    assert (m.REPO / args.training_script).is_file()
    from examples.train_ddp import parse_args

    parse_args(args.training_script_args)
    if doc["kind"] == "Job":
        assert args.rdzv_backend == "etcd-v3"
        assert len(args.rdzv_endpoint.split(",")) == 3, "list every etcd member"
        assert args.local_addr == SAMPLE_FIELDS["status.podIP"]
        # A pod recreated after the run finished exits 0 at once (the finished marker), on any API server.
        from elastic.config import parse_rdzv_conf

        assert int(parse_rdzv_conf(args.rdzv_conf).get("finished_ttl", 0)) > 0
    # Grace: the pod's grace covers the agent's emergency-save budget (--shutdown-timeout) plus leaving.
    pod = m.pod_template(doc)["spec"]
    assert args.shutdown_timeout is not None
    assert pod["terminationGracePeriodSeconds"] >= args.shutdown_timeout + 10
    # ... and the preemption helper's save budget (SIGTERM is a notice for workers that use it).
    assert args.preempt_grace is not None
    assert pod["terminationGracePeriodSeconds"] >= args.preempt_grace + 10
    # preStop sends SIGTERM to the agent (PID 1) and waits for it.
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["/bin/sh", "-c"] and "kill -TERM 1" in hook[2]
    assert container["workingDir"] == _dockerfile_workdir()


# --- image and Slurm -----------------------------------------------------------------------------------------

def _dockerfile_workdir() -> str:
    (workdir,) = re.findall(r"^WORKDIR\s+(\S+)", m.DOCKERFILE.read_text(), re.MULTILINE)
    return workdir


def test_image_holds_the_project_and_its_examples() -> None:
    text = m.DOCKERFILE.read_text()
    copied = {src.rstrip("/") for src, _ in re.findall(r"^COPY\s+(\S+)\s+(\S+)", text, re.MULTILINE)}
    assert {"elastic", "checkpoint", "examples", "pyproject.toml"} <= copied
    assert re.search(r'^RUN pip install .*"\.\[s3\]"', text, re.MULTILINE), "install the project itself, with S3 support"
    assert not re.search(r"^ENTRYPOINT", text, re.MULTILINE), "the agent must be PID 1 to get SIGTERM from the kubelet"


def test_slurm_script_signals_the_agents_and_requeues() -> None:
    text = m.SBATCH.read_text()
    directives = m.sbatch_directives(text)
    assert "requeue" in directives
    signal = directives["signal"]
    assert not signal.startswith(("B:", "R:B:")), "B: signals only the batch shell, never the agents"
    sig, _, lead = signal.partition("@")
    assert sig in ("TERM", "SIGTERM", "15"), "the agent turns SIGTERM into save-then-leave; other signals kill it"
    srun = m.sbatch_srun_argv(text)
    assert "--ntasks-per-node=1" in srun or directives.get("ntasks-per-node") == "1"
    launcher = srun.index("spotrun")
    args = build_parser().parse_args(srun[launcher + 1:])
    assert args.rdzv_backend == "etcd-v3"
    assert args.shutdown_timeout is not None and args.shutdown_timeout + 10 <= int(lead), \
        "the emergency-save budget must end before the time limit"
    assert args.preempt_grace is not None and args.preempt_grace + 10 <= int(lead), \
        "the preemption helper's save budget must end before the time limit"


def _comment_bullets(path: Path) -> dict[str, str]:
    """The header comment's bullets (``# - name: text``, continued by ``#   ...``): first words -> whole text."""
    bullets: dict[str, str] = {}
    head = ""
    for line in path.read_text().splitlines():
        if line.startswith("# - "):
            head = line[4:].split(":", 1)[0]
            bullets[head] = line[4:]
        elif line.startswith("#   ") and head:
            bullets[head] += " " + line[4:]
        else:
            head = ""
    return bullets


def test_job_yaml_says_what_to_keep_below_the_preemption_notice_in_the_preemption_bullet() -> None:
    # The grace period (budget + 30 s) must stay below the cloud's notice; a bullet inserted mid-paragraph once
    # made the sentence read as if it were about finished_ttl (a day).
    bullets = _comment_bullets(m.KUBERNETES / "job.yaml")
    (owner,) = [head for head, text in bullets.items() if "Keep it below your cloud's preemption notice" in text]
    assert owner == "preemption"
    assert "terminationGracePeriodSeconds = budget + 30 s" in bullets[owner]
