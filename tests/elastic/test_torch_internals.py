"""torch internals the agent copies, overrides or patches: fingerprints and run-time checks.

Each entry of ``FINGERPRINTS`` is a torch function spotrun copied or overrides (see the ``CHANGE:`` markers
in elastic/agent.py and elastic/launcher.py), with the hash of its source in the verified torch release and
what to re-check when it changes. A failure here means torch changed that function: read the new source,
port or re-check as the message says, then update the hash.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SubprocessContext

from elastic.api import TorchInternalsError
from elastic.torch_internals import VERIFIED_TORCH, check_agent_internals, require, worker_processes

pytestmark = pytest.mark.timeout(60)

_AGENT = "torch.distributed.elastic.agent.server"
_MP = "torch.distributed.elastic.multiprocessing.api"

FINGERPRINTS: dict[str, tuple[str, str]] = {
    # qualified name: (sha256[:16] of inspect.getsource in torch VERIFIED_TORCH, what to re-check when it changes)
    f"{_AGENT}.api.SimpleElasticAgent._invoke_run": (
        "376e457facabbfbc", "SpotrunAgent._invoke_run is a copy with CHANGE: markers; port the change"),
    f"{_AGENT}.api.SimpleElasticAgent._rendezvous": (
        "f0c843d67c04a7fc", "SpotrunAgent._rendezvous wraps it (events, restart refund after a membership change)"),
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._start_workers": (
        "3a15b68937f57e63", "SpotrunAgent._start_workers expects it to set self._pcontext (close patch, DeathClock)"),
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._monitor_workers": (
        "4ba1c04fe76bba95", "SpotrunAgent._monitor_workers wraps it (early terminate, complete_failures)"),
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._stop_workers": (
        "80fd695926105a38", "SpotrunAgent._stop_workers replaces it with _shutdown(timeout=stop_grace)"),
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._shutdown": (
        "615c6a545ee67bcf", "SpotrunAgent._stop_workers calls it with a short timeout"),
    f"{_MP}.PContext.close": (
        "b77c260c4568f068", "agent._default_close_timeout wraps it and keeps its (death_sig, timeout) call shape"),
    f"{_MP}.MultiprocessContext._poll": (
        "5b291186e8aaa27a", ("agent._default_close_timeout exists because _poll calls self.close() with the 30 s "
                             "default; complete_failures because it reports only the first dead process")),
    f"{_MP}.MultiprocessContext._start": (
        "7877a375514bf7e6", "torch_internals.worker_processes reads the _pc it sets"),
    "torch.multiprocessing.spawn.ProcessContext.join": (
        "785391c17c9e47af", "SpotrunAgent._monitor_workers terminates survivors itself because join waits 30 s before SIGKILL"),
    "torch.distributed.launcher.api.launch_agent": (
        "01534e5e0ad77098", "elastic.launcher.launch mirrors it step for step; port the change"),
}


def _resolve(qualified: str) -> Any:
    """The object named by a dotted ``module.Class.attr`` path (longest importable module prefix)."""
    parts = qualified.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = __import__(".".join(parts[:split]), fromlist=["_"])
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualified)


def _source_hash(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


@pytest.mark.parametrize("qualified", sorted(FINGERPRINTS))
def test_copied_or_overridden_torch_function_is_unchanged(qualified: str) -> None:
    expected, recheck = FINGERPRINTS[qualified]
    try:
        actual = _source_hash(_resolve(qualified))
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"torch no longer has {qualified} ({exc}); re-check: {recheck}")
    assert actual == expected, (
        f"torch changed {qualified} since torch {VERIFIED_TORCH} (source hash {actual}, verified {expected}). "
        f"Re-check: {recheck}. Then update its hash in tests/elastic/test_torch_internals.py."
    )


def test_a_missing_agent_hook_is_named_with_the_verified_torch_release(tmp_path: Any) -> None:
    from tests.elastic.test_agent_membership import PollingHandler, make_agent

    agent = make_agent(PollingHandler(), tmp_path)
    check_agent_internals(agent)  # the installed torch has them all
    del agent._remaining_restarts
    with pytest.raises(TorchInternalsError, match=rf"SimpleElasticAgent\._remaining_restarts as of torch {VERIFIED_TORCH}"):
        check_agent_internals(agent)


def test_require_names_the_internal_and_what_changed() -> None:
    require(True, "X._y", "unused")
    with pytest.raises(TorchInternalsError, match=r"torch internal X\._y .*pinned <2\.14.*: it is gone\. Re-check"):
        require(False, "X._y", "it is gone")


def test_worker_processes_only_for_a_started_multiprocess_context() -> None:
    subprocess_context = SubprocessContext.__new__(SubprocessContext)
    assert worker_processes(subprocess_context) is None  # binaries: no multiprocessing objects, not an error
    broken = MultiprocessContext.__new__(MultiprocessContext)
    broken._pc = None  # type: ignore[assignment]  # the torch change this test simulates
    with pytest.raises(TorchInternalsError, match=r"MultiprocessContext\._pc\.processes"):
        worker_processes(broken)
