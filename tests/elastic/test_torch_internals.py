"""torch internals spotrun relies on: their fingerprints per tested torch release, and the start-up check.

Each entry of ``elastic.torch_internals.INTERNALS`` is a torch function spotrun copies, overrides, patches or
calls although torch keeps it private, with the hash of its source in every tested torch release. A failure
of the fingerprint test means torch changed that function: read the new source, port or re-check as the
message says, then update its hash (``python -m elastic.torch_internals`` prints them all).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, PContext, SubprocessContext

from elastic import torch_internals
from elastic.api import TorchInternalsError
from elastic.torch_internals import (
    FINGERPRINTS,
    INTERNALS,
    TESTED_TORCH,
    Internal,
    check_agent_internals,
    check_torch,
    release_of,
    require,
    resolve,
    source_hash,
    verify_torch,
    worker_processes,
)
from tests.harness.procs import REPO, make_env

pytestmark = pytest.mark.timeout(60)

RELEASE = release_of(torch.__version__)


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: i.name)
def test_torch_internal_is_unchanged_in_the_installed_release(internal: Internal) -> None:
    assert RELEASE in TESTED_TORCH and RELEASE in FINGERPRINTS, (
        f"torch {torch.__version__} is not a tested release {TESTED_TORCH}: add its fingerprints "
        "(python -m elastic.torch_internals) after re-checking every internal that changed")
    try:
        obj = resolve(internal.path)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"torch {torch.__version__} no longer has {internal.path} ({exc}); re-check: {internal.reliance}")
    expected = FINGERPRINTS[RELEASE].get(internal.path)
    if expected is None:
        with pytest.raises((TypeError, OSError)):
            source_hash(obj)  # only a C binding has no fingerprint: its start-up check covers it
        return
    actual = source_hash(obj)
    assert actual == expected, (
        f"torch {torch.__version__} changed {internal.path} (source hash {actual}, torch {RELEASE} verified as "
        f"{expected}). Re-check: {internal.reliance}. Then update its hash in elastic/torch_internals.py.")


def test_every_tested_release_fingerprints_the_same_internals() -> None:
    assert sorted(FINGERPRINTS) == sorted(TESTED_TORCH)
    paths = {internal.path for internal in INTERNALS}
    for release, hashes in FINGERPRINTS.items():
        assert set(hashes) <= paths, f"torch {release}: fingerprints of internals spotrun no longer uses"
        assert set(hashes) == set(FINGERPRINTS[TESTED_TORCH[0]]), f"torch {release}: an internal without a hash"


def test_every_internal_passes_its_runtime_check_on_the_installed_torch() -> None:
    result = check_torch()
    assert result.failed == {}
    assert result.tested
    assert len(result.checked) == len(INTERNALS)


def test_a_tested_release_starts_without_a_notice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="elastic.torch_internals"):
        verify_torch(version=f"{TESTED_TORCH[-1]}.3")
    assert caplog.records == []


def test_a_newer_torch_is_said_once_with_every_internal_checked(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="elastic.torch_internals"):
        result = verify_torch(version="2.99.0")
    assert not result.tested
    [record] = caplog.records
    message = record.getMessage()
    assert "torch 2.99.0 is outside the releases spotrun is tested with (torch 2.13, 2.14 and 2.15)" in message
    assert f"all {len(INTERNALS)} runtime checks" in message and "passed" in message
    for internal in INTERNALS:
        assert internal.name in message


def _changed_close(self: Any, sig: Any = None, grace: int = 30) -> None:
    """PContext.close as a newer torch might reshape it (renamed parameters)."""


def test_a_failing_check_on_a_newer_torch_fails_at_start_naming_the_internal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(PContext, "close", _changed_close)
    with caplog.at_level(logging.WARNING, logger="elastic.torch_internals"), \
            pytest.raises(TorchInternalsError) as info:
        verify_torch(version="2.99.0")
    message = str(info.value)
    assert message.startswith("spotrun cannot run on torch 2.99.0: 1 of the")
    assert "PContext.close: its parameters are now ['self', 'sig', 'grace']" in message
    assert "known to work with torch 2.13, 2.14 and 2.15" in message
    assert caplog.records == []  # no "running" notice before the error


def test_a_missing_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(MultiprocessContext, "_poll")
    result = check_torch(version="2.99.0")
    assert list(result.failed) == ["MultiprocessContext._poll"]
    assert result.failed["MultiprocessContext._poll"] == "MultiprocessContext no longer defines it (only inherits it)"


def test_an_attribute_no_longer_set_is_named() -> None:
    gone = Internal(f"{MultiprocessContext.__module__}.MultiprocessContext._start", "test",
                    mentions=("self._pc = ", "self._processes_v2 ="))
    assert check_torch(internals=(gone,)).failed == {
        "MultiprocessContext._start": "it no longer contains 'self._processes_v2 ='"}


def test_the_cli_fails_at_start_with_one_line_on_an_unusable_newer_torch(tmp_path: Any) -> None:
    """The whole path a user sees: torch reports 2.99.0 and has a reshaped PContext.close; spotrun exits 1 with
    one line before it starts etcd or any worker (the script would create a file)."""
    marker = tmp_path / "worker-ran"
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    driver = (
        "import sys, torch\n"
        "from torch.distributed.elastic.multiprocessing.api import PContext\n"
        "torch.__version__ = '2.99.0'\n"
        "PContext.close = lambda self, sig=None, grace=30: None\n"
        "from elastic.cli import main\n"
        # the command line (argv None), as the spotrun command runs it: main(list) is the in-process API, which
        # raises as torchrun's main(argv) does
        f"sys.argv = ['spotrun', '--standalone', '--nproc-per-node', '1', {str(script)!r}]\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", driver], cwd=REPO, env=make_env(), capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("spotrun: error: spotrun cannot run on torch 2.99.0"), \
        proc.stderr
    assert "PContext.close" in lines[-1] and "known to work with torch 2.13, 2.14 and 2.15" in lines[-1]
    assert not marker.exists()


def test_verify_once_checks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []
    monkeypatch.setattr(torch_internals, "verify_torch", lambda: calls.append(None) or "checked")
    torch_internals.verify_torch_once.cache_clear()
    try:
        assert torch_internals.verify_torch_once() == "checked"
        assert torch_internals.verify_torch_once() == "checked"
        assert len(calls) == 1
    finally:
        torch_internals.verify_torch_once.cache_clear()  # the next caller checks the real torch


def test_a_missing_agent_hook_is_named(tmp_path: Any) -> None:
    from tests.elastic.test_agent_membership import PollingHandler, make_agent

    agent = make_agent(PollingHandler(), tmp_path)
    check_agent_internals(agent)  # the installed torch has them all
    del agent._remaining_restarts
    with pytest.raises(TorchInternalsError, match=r"SimpleElasticAgent\._remaining_restarts, but the installed"):
        check_agent_internals(agent)


def test_require_names_the_internal_and_the_releases_known_to_work() -> None:
    require(True, "X._y", "unused")
    with pytest.raises(TorchInternalsError, match=r"torch internal X\._y, .*: it is gone\. spotrun is known to work "
                                                  r"with torch 2\.13, 2\.14 and 2\.15"):
        require(False, "X._y", "it is gone")


def test_worker_processes_only_for_a_started_multiprocess_context() -> None:
    subprocess_context = SubprocessContext.__new__(SubprocessContext)
    assert worker_processes(subprocess_context) is None  # binaries: no multiprocessing objects, not an error
    broken = MultiprocessContext.__new__(MultiprocessContext)
    broken._pc = None  # type: ignore[assignment]  # the torch change this test simulates
    with pytest.raises(TorchInternalsError, match=r"MultiprocessContext\._pc\.processes"):
        worker_processes(broken)


@pytest.mark.parametrize(("version", "release"), [("2.15.0+cu128", "2.15"), ("2.14.1", "2.14"), ("3.0.0a0", "3.0")])
def test_release_of(version: str, release: str) -> None:
    assert release_of(version) == release
