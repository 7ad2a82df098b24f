"""The traceback filter of the partition tests (tests/harness/tracebacks.py), on logs shaped like theirs."""

from __future__ import annotations

from tests.harness.tracebacks import unexpected_tracebacks

_WORKER = """2026-11-28 03:12:32,100 INFO elastic.agent: [default round=1] something
[rank1]: Traceback (most recent call last):
[rank1]:   File "examples/train_ddp.py", line 382, in <module>
[rank1]:     main()
[rank1]:   File "torch/distributed/distributed_c10d.py", line 4287, in all_gather
[rank1]:     work.wait()
[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.231.7.11]:42408.
2026-11-28 03:12:32,254 INFO elastic.agent: [default round=1] workers exited after the peer loss
"""


def test_a_workers_broken_collective_is_expected() -> None:
    assert unexpected_tracebacks(_WORKER) == []


def test_a_workers_other_error_is_not() -> None:
    log = _WORKER.replace("Connection closed by peer", "index out of range")
    assert unexpected_tracebacks(log) == ["RuntimeError: [gloo/transport/tcp/pair.cc:553] index out of range "
                                          "[10.231.7.11]:42408."]


def test_an_agents_traceback_is_not() -> None:
    log = _WORKER + "Traceback (most recent call last):\n  File \"elastic/agent.py\", line 1\nValueError: x\n"
    assert unexpected_tracebacks(log) == ["Traceback (most recent call last):"]


def test_each_of_two_workers_is_judged_on_its_own_error() -> None:
    other = _WORKER.replace("[rank1]", "[rank0]").replace("Connection closed by peer", "CUDA error")
    assert unexpected_tracebacks(_WORKER + other) == ["RuntimeError: [gloo/transport/tcp/pair.cc:553] CUDA error "
                                                      "[10.231.7.11]:42408."]
