"""Read deploy/ as Kubernetes and Slurm would: YAML documents, pod templates, container environments and
command lines with Kubernetes' ``$(VAR)`` expansion, and the operator-generated environment of a PyTorchJob."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SBATCH = DEPLOY / "slurm" / "spotrun.sbatch"
DOCKERFILE = DEPLOY / "Dockerfile"

#: elasticPolicy fields of the training-operator's kubeflow.org/v1 PyTorchJob (ElasticPolicy in its Go types).
PYTORCHJOB_ELASTIC_FIELDS = frozenset({
    "minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId", "rdzvConf", "standalone",
    "nProcPerNode", "maxRestarts", "metrics",
})

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in documents(path):
            yield path, doc


def find(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents(path) if d["kind"] == kind]
    return doc


def pod_template(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a workload (Job, StatefulSet, or a PyTorchJob's Worker replica)."""
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return doc["spec"]["template"]


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``command``/``args``/``env`` values: ``$(VAR)`` when VAR is defined (else left
    as written), ``$$`` is a literal ``$``."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR.sub(sub, text)


def container_env(container: dict[str, Any], fields: Mapping[str, str], base: Mapping[str, str] = {}) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``base`` (e.g. operator-injected variables), then
    each entry in order, values expanded against what is defined so far, ``fieldRef`` from ``fields``."""
    env = dict(base)
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
        else:
            field = entry["valueFrom"]["fieldRef"]["fieldPath"]
            if field not in fields:
                raise KeyError(f"the test gives no value for fieldRef {field!r} (env {entry['name']})")
            env[entry["name"]] = fields[field]
    return env


def container_argv(container: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    return [expand(str(a), env) for a in [*container.get("command", []), *container.get("args", [])]]


def pytorchjob_env(job: dict[str, Any]) -> dict[str, str]:
    """What the training-operator adds to each Worker for an elasticPolicy (its ElasticEnvVarGenerator)."""
    policy = job["spec"]["elasticPolicy"]
    env = {
        "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
    }
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nProcPerNode" in policy:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = str(policy["rdzvId"])
    return env


def sbatch_directives(text: str) -> dict[str, str]:
    """``#SBATCH --key=value`` lines -> {key: value} (value "" for a bare flag)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            for token in shlex.split(line[len("#SBATCH"):]):
                key, _, value = token.lstrip("-").partition("=")
                out[key] = value
    return out


def sbatch_srun_argv(text: str) -> list[str]:
    """The srun command of the batch script, continuation lines joined, shell words unexpanded."""
    joined = text.replace("\\\n", " ")
    (line,) = [ln for ln in joined.splitlines() if ln.strip().startswith("srun ")]
    return shlex.split(line)


def flag_value(argv: list[str], flag: str) -> str | None:
    """Value of ``--flag=value`` or ``--flag value`` in an argv, None if absent."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None
