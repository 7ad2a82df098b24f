"""elastic.worker.abort: the socket-table decisions on plain data, and two real gloo processes where the
survivor's blocked ``all_reduce`` raises once a watcher thread aborts the group (peer paused or killed)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from elastic.worker.abort import (
    TCP_CLOSE_WAIT,
    TCP_ESTABLISHED,
    GroupAbortError,
    TcpConnection,
    connections_to_shut,
    parse_socket_table,
    socket_inodes,
    store_ports,
    tcp_connections,
)
from tests.harness.procs import Launcher, free_port, make_env, wait_for

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
TABLE4 = HEADER + (
    "   0: 0100007F:9641 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0\n"
    "   1: 0100007F:9641 0100007F:D618 01 00000000:00000000 00:00000000 00000000  1000        0 112 1 0\n"
    "   2: 0100007F:D618 0100007F:9641 01 00000000:00000000 00:00000000 00000000  1000        0 999 1 0\n"
)
TABLE6 = HEADER + (
    "   0: 0000000000000000FFFF00000100007F:822E 0000000000000000FFFF00000100007F:784C 01 00000000:00000000 "
    "00:00000000 00000000  1000        0 113 1 0\n"
)


def test_the_socket_table_is_read_by_inode_with_ports_and_state() -> None:
    assert parse_socket_table(TABLE4) == {111: (0x9641, 0, 0x0A), 112: (0x9641, 0xD618, 1), 999: (0xD618, 0x9641, 1)}
    assert parse_socket_table(TABLE6) == {113: (0x822E, 0x784C, 1)}
    with pytest.raises(GroupAbortError, match="unexpected line"):
        parse_socket_table(HEADER + "   0: garbage\n")


def test_only_this_processs_sockets_are_joined_with_the_tables() -> None:
    fds = {3: "socket:[111]", 4: "socket:[112]", 5: "/dev/null", 6: "socket:[113]", 7: "pipe:[112]"}
    assert socket_inodes(fds) == {111: 3, 112: 4, 113: 6}
    found = tcp_connections(fds, [TABLE4, TABLE6])  # inode 999 is another process's
    assert found == [TcpConnection(3, 0x9641, 0, 0x0A), TcpConnection(4, 0x9641, 0xD618, 1), TcpConnection(6, 0x822E, 0x784C, 1)]


def test_open_connections_are_shut_except_the_stores_and_listeners() -> None:
    store = 0x784C
    connections = [
        TcpConnection(3, 0x9641, 0, 0x0A),               # a listening socket: left
        TcpConnection(4, 0x9641, 0xD618, TCP_ESTABLISHED),  # a gloo pair: shut
        TcpConnection(5, 0x822E, store, TCP_ESTABLISHED),   # this rank's store client: kept
        TcpConnection(6, store, 0x822E, TCP_ESTABLISHED),   # the store this rank hosts: kept
        TcpConnection(7, 0x1234, 0x5678, TCP_CLOSE_WAIT),   # a pair whose peer closed: shut
        TcpConnection(8, 0x1235, 0x5679, 0x06),             # TIME_WAIT: nothing to wake
    ]
    assert connections_to_shut(connections, {store}) == [4, 7]


def test_the_store_port_comes_from_master_port_and_the_callers_list() -> None:
    assert store_ports({"MASTER_PORT": "29500"}, [2379]) == {29500, 2379}
    assert store_ports({}, ()) == set()
    assert store_ports({"MASTER_PORT": "not-a-port"}) == set()


def _start(tmp_path: Path, port: int, rank: int) -> Launcher:
    env = make_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    argv = [sys.executable, "-u", str(Path(__file__).with_name("abort_job.py")), "--dir", str(tmp_path)]
    return Launcher(argv, tmp_path / f"rank{rank}.log", env)


def _stuck(progress: Path, quiet: float = 0.3) -> bool:
    """True once ``progress`` has not changed for ``quiet`` seconds (the rank is blocked in a collective)."""
    before = progress.read_text()
    deadline = time.monotonic() + quiet
    while time.monotonic() < deadline:
        if progress.read_text() != before:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["peer-paused", "peer-killed"])
def test_a_blocked_all_reduce_raises_once_the_group_is_aborted(tmp_path: Path, fault: signal.Signals) -> None:
    port = free_port()
    survivor, peer = _start(tmp_path, port, 0), _start(tmp_path, port, 1)
    try:
        progress = tmp_path / "progress-0"
        wait_for(lambda: progress.exists() and int(progress.read_text() or 0) >= 20, 60, "both ranks training")
        peer.signal(fault)
        wait_for(lambda: _stuck(progress), 10, "the survivor blocked in all_reduce")
        (tmp_path / "trigger").touch()
        assert survivor.wait(20) == 0, survivor.output()[-3000:]
        result = json.loads((tmp_path / "result-0.json").read_text())
        if fault == signal.SIGSTOP:  # only the abort could end the wait: the peer's connections stayed open
            assert not result["raised_before_abort"], result
            assert result["connections_shut"] >= 1, result
            assert result["abort_to_raise"] < 1.0, result
        else:  # the peer's closed socket already ended it (the abort afterwards is harmless)
            assert result["raised_before_abort"], result
        assert result["later"] == "raised" and result["later_seconds"] < 1.0, result
        assert result["store"] == "ok", result  # the store's connections were kept
        assert (tmp_path / "snap-0.safetensors").stat().st_size > 64 * 64 * 4
    finally:
        peer.close(grace=5)
        survivor.close(grace=5)


def test_after_an_abort_the_checkpointers_collectives_start_nothing(tmp_path) -> None:
    """A send or collective started on an aborted gloo group can wait forever: after ``abort_process_group`` the
    checkpointer's and memory tier's ``Collective`` raise at once, until the process joins another group."""
    import torch.distributed as dist

    from checkpoint.collective import Collective, GroupsAbortedError, clear_groups_aborted
    from elastic.worker.abort import abort_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        own = Collective(dist.new_group(backend="gloo"), rank=0, world_size=1)
        assert own.max(3) == 3
        abort_process_group()
        with pytest.raises(GroupsAbortedError, match="aborted"):
            own.max(3)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    try:
        assert Collective(dist.new_group(backend="gloo"), rank=0, world_size=1).max(4) == 4, "a new default group"
    finally:
        dist.destroy_process_group()
        clear_groups_aborted()
