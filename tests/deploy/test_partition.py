"""A network partition (issue 16): two agents, each in its own network namespace, etcd on a third host of the
bridge; one node's link is cut (every packet dropped both ways: no RST, no FIN) and later restored.

* Cut for less than ``etcd_timeout``: the cut-off node rides it out like any etcd outage (grpc's
  "tcp handshaker shutdown" is not a TLS failure), its peer goes on alone meanwhile, and once the link is back
  the node rejoins and the job ends with the weights of an uninterrupted run (``--deterministic``: bit-identical
  whatever the world size, so the reference is one plain process).
* Cut for longer than ``etcd_timeout``: the cut-off node ends on its own, naming the outage, without a
  traceback; its peer trains on to the end, again with the reference weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elastic.etcd_server import find_etcd_binary
from tests.chaos.jobs import final_state
from tests.deploy.netlab import FORCE_LOOPBACK_ENV, NetLab, loopback_reason
from tests.harness.procs import EXAMPLES, REPO, Timeout, read_jsonl, wait_for
from tests.harness.tracebacks import unexpected_tracebacks

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(420)]

STEPS = 60
TRAIN = [str(EXAMPLES / "train_ddp.py"), "--deterministic", "--global-batch", "64", "--dataset-size", "1000",
         "--steps", str(STEPS), "--ckpt-every", "5", "--log-every", "1", "--step-time", "0.3",
         "--pg-timeout", "60"]  # fmt: skip
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=120"


@dataclass
class Lab:
    lab: NetLab
    root: Path
    env: dict[str, str]
    etcd: str

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.root.glob("*.log")))


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    reason = loopback_reason()
    if reason is not None:
        if os.environ.get(FORCE_LOOPBACK_ENV):
            pytest.skip(f"a partition needs network namespaces: {reason}")
        pytest.fail(f"a partition needs network namespaces (run as root with iproute2): {reason}")
    net = NetLab(isolated=True)
    etcd_host = net.add("etcd", "etcd-0")
    for key in ("a", "b"):
        net.add(key, f"node-{key}")
    etcd_bin = find_etcd_binary()
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), str(Path(etcd_bin).parent), "/usr/sbin",
                                    "/usr/bin", "/sbin", "/bin"]),
           "PYTHONPATH": str(REPO), "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
           "LOGLEVEL": "INFO"}  # fmt: skip
    try:
        net.start()
        with open(tmp_path / "etcd.log", "wb") as log:
            net.popen("etcd", [etcd_bin, "--name", "etcd-0", "--data-dir", str(tmp_path / "etcd-data"),
                               "--listen-client-urls", "http://0.0.0.0:2379",
                               "--advertise-client-urls", f"http://{etcd_host.addr}:2379",
                               "--listen-peer-urls", "http://127.0.0.1:2380",
                               "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                               "--initial-cluster", "etcd-0=http://127.0.0.1:2380"],
                      env=env, cwd=tmp_path, log=log)  # fmt: skip
        lab = Lab(net, tmp_path, env, "etcd-0:2379")
        etcdctl = str(Path(etcd_bin).with_name("etcdctl"))
        wait_for(lambda: net.run("a", [etcdctl, f"--endpoints={lab.etcd}", "endpoint", "health"], env=env,
                                 timeout=10).returncode == 0, 30, "etcd to answer from node a")
        yield lab
    finally:
        net.close()


def _agent(lab: Lab, key: str, etcd_timeout: float, ckpt: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "elastic.cli", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "5",
            "--rdzv-endpoint", lab.etcd, "--rdzv-id", "partition", "--events-file", str(lab.root / f"events-{key}.jsonl"),
            "--rdzv-conf", f"{RDZV_CONF},etcd_timeout={etcd_timeout:g}",
            *TRAIN, "--ckpt-dir", str(ckpt), "--progress-file", str(lab.root / f"progress-{key}.jsonl")]  # fmt: skip
    with open(lab.root / f"agent-{key}.log", "wb") as log:
        return lab.lab.popen(key, argv, env=lab.env, cwd=REPO, log=log)


def _until(lab: Lab, check: Callable[[], object], timeout: float, what: str) -> None:
    try:
        wait_for(check, timeout, what)
    except Timeout as exc:
        pytest.fail(f"{exc}\n{lab.logs()}")


def _progress(lab: Lab, key: str) -> list[dict]:
    path = lab.root / f"progress-{key}.jsonl"
    return read_jsonl(path) if path.exists() else []


def _last_step(lab: Lab) -> int:
    return max((r["step"] for key in ("a", "b") for r in _progress(lab, key)), default=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run: one plain process (``--deterministic`` is bit-identical at any world size)."""
    ckpt = tmp_path_factory.mktemp("reference") / "ckpt"
    result = subprocess.run([sys.executable, *TRAIN, "--step-time", "0", "--ckpt-dir", str(ckpt)], cwd=REPO,
                            capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    step, state = final_state(str(ckpt))
    assert step == STEPS
    return state


def _assert_reference(ckpt: Path, reference: dict[str, torch.Tensor]) -> None:
    step, state = final_state(str(ckpt))
    assert step == STEPS
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), f"{name} differs from the uninterrupted run"


def _wait(proc: subprocess.Popen[bytes], timeout: float, lab: Lab, what: str) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} still running after {timeout} s\n{lab.logs()}")


def _cut_after_both_trained(lab: Lab, key: str) -> float:
    _until(lab, lambda: {r["world_size"] for r in _progress(lab, "a")} >= {2} and _last_step(lab) >= 6, 180,
             "both nodes training together")  # fmt: skip
    lab.lab.cut(key)
    return time.monotonic()


def test_a_partition_shorter_than_etcd_timeout_is_ridden_out_and_the_node_rejoins(
    lab: Lab, reference: dict[str, torch.Tensor]
) -> None:
    ckpt = lab.root / "ckpt"
    a, b = _agent(lab, "a", 40, ckpt), _agent(lab, "b", 40, ckpt)
    cut_at = _cut_after_both_trained(lab, "b")
    try:
        # The peer notices (lease TTL) and trains on alone while the link is down.
        step_at_cut = _last_step(lab)
        _until(lab, lambda: any(r["world_size"] == 1 and r["step"] > step_at_cut for r in _progress(lab, "a")), 60,
                 "node a training alone during the partition")  # fmt: skip
        assert b.poll() is None, f"node b ended during a {time.monotonic() - cut_at:.0f} s cut:\n{lab.logs()}"
        wait_for(lambda: time.monotonic() - cut_at >= 8, 20, "an 8 s partition")
        assert b.poll() is None, f"node b ended during the partition:\n{lab.logs()}"
    finally:
        lab.lab.restore("b")
    restored_at = time.time()
    _until(lab, lambda: any(r["world_size"] == 2 and r["t_wall"] > restored_at for r in _progress(lab, "b")), 120,
             "node b training in the group again after the link came back")  # fmt: skip
    assert _wait(a, 240, lab, "node a") == 0, lab.logs()
    assert _wait(b, 60, lab, "node b") == 0, lab.logs()
    b_log = (lab.root / "agent-b.log").read_text(errors="replace")
    assert "TLS" not in b_log and not unexpected_tracebacks(b_log), (unexpected_tracebacks(b_log), b_log[-4000:])
    _assert_reference(ckpt, reference)


def test_a_partition_longer_than_etcd_timeout_ends_the_node_cleanly_and_the_peer_goes_on(
    lab: Lab, reference: dict[str, torch.Tensor]
) -> None:
    ckpt = lab.root / "ckpt"
    a, b = _agent(lab, "a", 6, ckpt), _agent(lab, "b", 6, ckpt)
    _cut_after_both_trained(lab, "b")
    try:
        code = _wait(b, 60, lab, "node b, cut off for longer than etcd_timeout=6")
    finally:
        lab.lab.restore("b")
    b_log = (lab.root / "agent-b.log").read_text(errors="replace")
    assert code != 0, b_log[-4000:]
    assert "unreachable for" in b_log and "etcd_timeout=6" in b_log, b_log[-4000:]
    assert "TLS" not in b_log and not unexpected_tracebacks(b_log), (unexpected_tracebacks(b_log), b_log[-4000:])
    assert _wait(a, 240, lab, "node a") == 0, lab.logs()
    assert max(r["step"] for r in _progress(lab, "a")) == STEPS
    _assert_reference(ckpt, reference)
