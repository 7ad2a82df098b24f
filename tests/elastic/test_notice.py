"""Preemption notice sources: pure parsers, and real local HTTP servers answering like each metadata service."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from elastic.api import LaunchConfigError
from elastic.notice import (
    AwsInstanceAction,
    AwsRebalance,
    AzurePreempt,
    GcpPreempted,
    Notice,
    NoticePoller,
    earliest,
    parse_aws_instance_action,
    parse_azure_events,
    parse_gcp_preempted,
    parse_signal_spec,
    parse_sources,
)

NOW = 1_800_000_000.0


# --- pure parsers -------------------------------------------------------------------------------------------


def test_aws_instance_action_deadline_is_the_time_aws_gives() -> None:
    assert parse_aws_instance_action(404, "Not Found", NOW) is None
    notice = parse_aws_instance_action(200, '{"action": "terminate", "time": "2027-01-15T08:00:00Z"}', NOW)
    assert notice is not None and notice.source == "aws"
    assert notice.deadline == datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp()
    with pytest.raises(ValueError):
        parse_aws_instance_action(500, "", NOW)


def test_gcp_and_azure_parsers() -> None:
    assert parse_gcp_preempted(200, "FALSE", NOW) is None
    assert parse_gcp_preempted(200, "TRUE", NOW) == Notice("gcp", NOW + 30.0, "instance/preempted is TRUE")
    with pytest.raises(ValueError, match="TRUE or FALSE"):
        parse_gcp_preempted(200, "maybe", NOW)
    events = {"DocumentIncarnation": 2, "Events": [
        {"EventId": "a", "EventType": "Reboot", "Resources": ["vm1"], "NotBefore": "Mon, 18 Jan 2027 08:00:00 GMT"},
        {"EventId": "b", "EventType": "Preempt", "Resources": ["vm2"], "NotBefore": "Mon, 18 Jan 2027 08:00:30 GMT"},
    ]}
    body = json.dumps(events)
    notice = parse_azure_events(200, body, NOW)
    assert notice is not None and notice.source == "azure" and "b" in notice.detail
    assert parse_azure_events(200, body, NOW, vm_name="vm1") is None  # the Preempt is for another VM
    assert parse_azure_events(200, json.dumps({"Events": []}), NOW) is None


def test_signal_spec_and_sources_are_validated() -> None:
    assert parse_signal_spec("USR2@120", 30.0) == (signal.SIGUSR2, 120.0)
    assert parse_signal_spec("sigusr1", 30.0) == (signal.SIGUSR1, 30.0)
    with pytest.raises(LaunchConfigError, match="unknown signal"):
        parse_signal_spec("NOPE", 30.0)
    with pytest.raises(LaunchConfigError, match="cannot be a notice"):
        parse_signal_spec("KILL", 30.0)
    with pytest.raises(LaunchConfigError, match="seconds"):
        parse_signal_spec("USR2@soon", 30.0)
    assert parse_sources("aws, gcp,aws") == ("aws", "gcp")
    with pytest.raises(LaunchConfigError, match="accepted: aws, aws-rebalance, gcp, azure"):
        parse_sources("aws,oracle")


def test_earliest_deadline_binds() -> None:
    a, b = Notice("sigterm", NOW + 30), Notice("aws", NOW + 10)
    assert earliest(a, b) is b and earliest(None, a) is a and earliest(a, None) is a


# --- real HTTP servers that answer like the metadata services ---------------------------------------------------


class FakeMetadata:
    """State the handler answers from; ``preempted`` flips the answers to a notice."""

    def __init__(self) -> None:
        self.preempted = False
        self.rebalance = False
        self.tokens_issued = 0
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()


def _handler(state: FakeMetadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _send(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:  # IMDSv2 session token
            with state.lock:
                state.requests.append(("PUT", self.path))
            if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                state.tokens_issued += 1
                self._send(200, f"token-{state.tokens_issued}")
            else:
                self._send(400, "missing X-aws-ec2-metadata-token-ttl-seconds")

        def do_GET(self) -> None:
            with state.lock:
                state.requests.append(("GET", self.path))
            if self.path.startswith("/latest/"):
                if not (self.headers.get("X-aws-ec2-metadata-token") or "").startswith("token-"):
                    return self._send(401, "")  # IMDSv2 refuses requests without a session token
                if self.path == "/latest/meta-data/spot/instance-action" and state.preempted:
                    return self._send(200, json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}))
                if self.path == "/latest/meta-data/events/recommendations/rebalance" and state.rebalance:
                    return self._send(200, json.dumps({"noticeTime": "2030-01-01T00:00:00Z"}))
                return self._send(404, "Not Found")
            if self.path == "/computeMetadata/v1/instance/preempted":
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "Missing Metadata-Flavor:Google header")
                return self._send(200, "TRUE" if state.preempted else "FALSE")
            if self.path.startswith("/metadata/scheduledevents"):
                if self.headers.get("Metadata") != "true" or "api-version=" not in self.path:
                    return self._send(400, '{"error": "Bad request: Metadata header / api-version required"}')
                events = [{"EventId": "E1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                           "Resources": ["vm0"], "EventStatus": "Scheduled",
                           "NotBefore": "Tue, 01 Jan 2030 00:00:30 GMT"}] if state.preempted else []
                return self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": events}))
            return self._send(404, "Not Found")

    return Handler


@pytest.fixture
def metadata() -> Iterator[tuple[str, FakeMetadata]]:
    state = FakeMetadata()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.timeout(30)
def test_aws_imdsv2_uses_one_session_token_and_reports_the_action(metadata: tuple[str, FakeMetadata]) -> None:
    url, state = metadata
    source = AwsInstanceAction(url)
    assert source.poll(NOW) is None and source.poll(NOW) is None
    assert state.tokens_issued == 1, "the IMDSv2 token is reused across polls"
    state.preempted = True
    notice = source.poll(NOW)
    assert notice is not None and notice.source == "aws"
    assert notice.deadline == pytest.approx(1893456120.0)  # 2030-01-01T00:02:00Z
    state.rebalance = True
    rebalance = AwsRebalance(url, grace=45.0).poll(NOW)
    assert rebalance == Notice("aws-rebalance", NOW + 45.0, "rebalance recommendation at 2030-01-01T00:00:00Z")


@pytest.mark.timeout(30)
def test_gcp_and_azure_sources_send_their_headers(metadata: tuple[str, FakeMetadata]) -> None:
    url, state = metadata
    gcp, azure = GcpPreempted(url), AzurePreempt(url)
    assert gcp.poll(NOW) is None and azure.poll(NOW) is None
    state.preempted = True
    assert gcp.poll(NOW) == Notice("gcp", NOW + 30.0, "instance/preempted is TRUE")
    notice = azure.poll(NOW)
    assert notice is not None and notice.deadline == pytest.approx(1893456030.0)


@pytest.mark.timeout(30)
def test_poller_reports_each_source_once_and_survives_a_dead_one(metadata: tuple[str, FakeMetadata]) -> None:
    url, state = metadata
    got: list[Notice] = []
    arrived = threading.Event()

    def on_notice(notice: Notice) -> None:
        got.append(notice)
        arrived.set()

    dead = GcpPreempted("http://127.0.0.1:9")  # nothing listens on the discard port: connection refused
    poller = NoticePoller([dead, AwsInstanceAction(url)], on_notice, interval=0.05, clock=lambda: NOW).start()
    try:
        assert not arrived.wait(0.3), "no notice before the service reports one"
        state.preempted = True
        assert arrived.wait(10), "the poller must report the notice"
        aws_polls = sum(1 for m, p in state.requests if p.endswith("instance-action"))
        for _ in range(5):
            poller.poll_once()
        assert [n.source for n in got] == ["aws"]
        assert sum(1 for m, p in state.requests if p.endswith("instance-action")) == aws_polls, \
            "a source that reported is not polled again"
    finally:
        poller.stop()


def test_cli_flags_and_env_fallbacks_build_validated_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.cli import build_parser, settings_from_args

    parser = build_parser()
    args = parser.parse_args(["--preempt-notice", "gcp,aws", "--preempt-signal", "USR2@120", "train.py"])
    monkeypatch.setenv("SPOTRUN_PREEMPT_GRACE", "45")
    settings = settings_from_args(args)
    assert settings.preempt_sources == ("gcp", "aws") and settings.preempt_signal == "USR2@120"
    assert settings.preempt_grace == 45.0 and settings.preempt_poll_interval == 2.0
    with pytest.raises(LaunchConfigError, match="accepted: aws, aws-rebalance, gcp, azure"):
        settings_from_args(parser.parse_args(["--preempt-notice", "oracle", "train.py"]))
    monkeypatch.setenv("SPOTRUN_PREEMPT_GRACE", "soon")
    with pytest.raises(LaunchConfigError, match="SPOTRUN_PREEMPT_GRACE"):
        settings_from_args(args)


def test_the_planned_change_env_names_live_in_elastic_api_and_the_old_imports_still_work() -> None:
    import elastic.api as api
    import elastic.notice as notice
    import elastic.planned as planned
    import elastic.preemption as preemption

    moved = {notice: ["ENV_PREEMPT_NOTICE", "ENV_PREEMPT_GRACE", "ENV_PREEMPT_SIGNAL", "ENV_PREEMPT_POLL_INTERVAL",
                      "ENV_AWS_METADATA_URL", "ENV_GCP_METADATA_URL", "ENV_AZURE_METADATA_URL"],
             planned: ["ENV_RESIZE_TIMEOUT", "ENV_PLANNED_LEAVE_EXIT_CODE"], preemption: ["ENV_NOTICE_DIR"]}
    for module, names in moved.items():
        for name in names:
            value = getattr(api, name)
            assert getattr(module, name) == value and value == "SPOTRUN_" + name[len("ENV_"):], name  # public: never renamed
