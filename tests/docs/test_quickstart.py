"""The commands of the quickstart page and the README are run here, as written (the checkpoint directory
moved into a temporary one): the demo (``bash examples/run.sh``) twice, resuming, the quickstart's two
``spotrun --standalone`` commands, resuming at another world size, and the several-nodes pair of each page
(``python -m elastic.etcd_server`` and two agents against an S3 API). The deployment commands are covered by
tests/deploy (real etcd members, TLS, network namespaces)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest

from checkpoint.storage import Storage
from tests.checkpoint.conftest import s3_options
from tests.harness.procs import REPO, SPOTRUN, Launcher, free_port, make_env, read_jsonl, run_cli, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _commands(path: Path, prefix: str, script: str = "examples/quickstart.py") -> list[list[str]]:
    """The lines of ``path``'s bash blocks that start with ``prefix`` and contain ``script`` (continuation
    lines joined)."""
    text = path.read_text()
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix) and script in line:
                out.append(shlex.split(line, comments=True))
    return out


def _run(argv: list[str], tmp: Path) -> str:
    argv = [str(tmp / "quickstart") if a == "runs/quickstart" else a for a in argv]
    assert argv[0] == "spotrun"
    result = run_cli([*SPOTRUN, *argv[1:]], timeout=240, env=make_env(LOGLEVEL="WARNING"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def _steps(stdout: str) -> list[tuple[int, int]]:
    """(step, world size) of rank 0's progress lines."""
    return [(int(s), int(w)) for s, w in re.findall(r"^step=(\d+) loss=\S+ world_size=(\d+)$", stdout, re.M)]


def test_quickstart_commands_train_and_resume_at_another_world_size(tmp_path: Path) -> None:
    first, second = _commands(REPO / "docs" / "quickstart.md", "spotrun --standalone")
    steps = _steps(_run(first, tmp_path))
    assert steps[0] == (1, 2) and steps[-1] == (40, 2), steps
    assert (tmp_path / "quickstart" / "step-000000040" / ".commit").is_file()
    # the page says: the second run resumes after step 40 (the last commit) at world size 1
    assert "`step=41 ... world_size=1`" in (REPO / "docs" / "quickstart.md").read_text()
    steps = _steps(_run(second, tmp_path))
    assert steps[0] == (41, 1) and steps[-1] == (60, 1), steps


def test_readme_commands_are_the_quickstart_commands() -> None:
    """The README's one-node command is the quickstart's first, run above (which adds only ``--steps``)."""
    (readme,) = _commands(REPO / "README.md", "spotrun --standalone")
    first, _ = _commands(REPO / "docs" / "quickstart.md", "spotrun --standalone")
    assert [*readme, "--steps", "45"] == first


def test_the_demo_command_trains_then_resumes(tmp_path: Path) -> None:
    """``bash examples/run.sh`` (the README's first command): STEPS and CKPT_DIR as the README says."""
    def demo(steps: int) -> list[dict[str, object]]:
        progress = tmp_path / f"progress-{steps}.jsonl"
        env = make_env(LOGLEVEL="WARNING", STEPS=str(steps), CKPT_DIR=str(tmp_path / "ckpt"))
        result = subprocess.run(["bash", "examples/run.sh", "--progress-file", str(progress)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert f"step={steps} " in result.stdout
        return read_jsonl(progress)

    first = demo(4)
    assert min(r["step"] for r in first) == 1  # type: ignore[type-var]
    second = demo(6)
    assert min(r["step"] for r in second) == 5, "the second run did not resume from the committed step 4"  # type: ignore[type-var]


# ------------------------------------------------------------------ several nodes
def _several_nodes_commands(path: Path) -> tuple[list[str], list[str]]:
    """The page's etcd server command and its agent command (the one run on every node)."""
    (server,) = _commands(path, "python -m elastic.etcd_server", script="")
    (agent,) = _commands(path, "spotrun --nnodes")
    return server, agent


def _start_etcd_server(server: list[str], tmp: Path) -> tuple[Launcher, int]:
    """``server`` as written, its ``--port`` (if the page gives one) moved to a free port; returns the
    launcher and the port it serves (read from its ``etcd endpoint: HOST:PORT`` line)."""
    assert server[:3] == ["python", "-m", "elastic.etcd_server"], server
    argv = [sys.executable, *server[1:]]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(free_port())
    launcher = Launcher(argv, tmp / "etcd_server.log", make_env())
    found = wait_for(lambda: re.search(r"^etcd endpoint: \S+:(\d+)$", launcher.output(), re.M)
                     or launcher.proc.poll() is not None, 60, "the etcd server to print its endpoint")
    assert isinstance(found, re.Match), f"the etcd server exited: {launcher.output()[-3000:]}"
    return launcher, int(found.group(1))


def _fill_in(agent: list[str], server: list[str], port: int, bucket: str) -> list[str]:
    """The agent command with its placeholders filled in: ``ETCD_HOST`` is loopback, the port is the server's
    (``PORT``, or the ``--port`` the server command gives, which was moved to a free one), ``s3://bucket/`` names
    ``bucket``, a fresh one. Anything else in the command is run as written."""
    assert agent[0] == "spotrun", agent
    host, _, written_port = agent[agent.index("--rdzv-endpoint") + 1].partition(":")
    assert host == "ETCD_HOST", f"--rdzv-endpoint {host}:{written_port}: the test fills in ETCD_HOST only"
    server_port = server[server.index("--port") + 1] if "--port" in server else "PORT"
    assert written_port == server_port, f"the agents reach port {written_port}, the server listens on {server_port}"
    ckpt_dir = agent[agent.index("--ckpt-dir") + 1]
    assert ckpt_dir.startswith("s3://bucket/"), f"--ckpt-dir {ckpt_dir}: the test fills in an s3://bucket/ only"
    filled = {f"ETCD_HOST:{written_port}": f"127.0.0.1:{port}", ckpt_dir: ckpt_dir.replace("bucket", bucket, 1)}
    return [*SPOTRUN, *(filled.get(a, a) for a in agent[1:])]


def _s3_env(endpoint: str) -> dict[str, str]:
    """moto's endpoint and credentials as environment variables that every process inherits (docs/guides/
    storage.md), none of the caller's AWS_* left over."""
    env = {k: v for k, v in make_env(LOGLEVEL="WARNING").items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL_S3=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    return env


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_several_nodes_commands_train_two_nodes_to_a_committed_s3_checkpoint(
    page: str, moto_endpoint: str, tmp_path: Path
) -> None:
    """The page's etcd server, then its agent command on two "nodes" (two agents on this host) with
    ``ETCD_HOST:PORT`` and the bucket filled in, against a real S3 API (moto_server over HTTP). The command
    names no S3 endpoint, so moto's comes from ``AWS_ENDPOINT_URL_S3`` and credentials from
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, as docs/guides/storage.md documents: the command text
    stays as written. Both agents exit 0, rank 0 reaches the script's last step (100, its default) at world
    size 4 (2 nodes x 2 workers), and that step is committed in the bucket."""
    server, agent = _several_nodes_commands(REPO / page)
    bucket = f"quickstart-{uuid.uuid4().hex[:10]}"
    options = s3_options(moto_endpoint)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    etcd, port = _start_etcd_server(server, tmp_path)
    agents: list[Launcher] = []
    try:
        argv = _fill_in(agent, server, port, bucket)
        agents = [Launcher(argv, tmp_path / f"node{i}.log", _s3_env(moto_endpoint)) for i in range(2)]
        codes = [a.wait(300) for a in agents]
        outputs = "\n".join(a.output() for a in agents)
        assert codes == [0, 0], outputs[-6000:]
        # rank 0 may have moved between the nodes' logs if a round re-formed: the last step is what counts
        steps = _steps(outputs)
        assert max(steps, default=None) == (100, 4), f"rank 0's progress lines: {steps}\n{outputs[-4000:]}"
    finally:
        for launcher in [*agents, etcd]:
            launcher.close()
    ckpt_dir = argv[argv.index("--ckpt-dir") + 1]
    storage = Storage(ckpt_dir, storage_options=options)
    assert storage.exists("step-000000100/.commit"), f"no committed step 100 in {ckpt_dir}: {sorted(storage.listdir())}"
    assert bytes(storage.read_bytes("latest")).decode().strip() == "step-000000100"
