"""Preemption notices: every source becomes one absolute deadline for this node.

Sources (each opt-in except SIGTERM, see ``cli``):

* ``SIGTERM`` to the agent (Kubernetes, GCP, systemd): deadline = now + ``--preempt-grace``;
* a configurable signal (Slurm ``#SBATCH --signal=USR2@120``): ``--preempt-signal USR2@120``;
* AWS instance metadata (IMDSv2): ``spot/instance-action`` (deadline given by AWS, 2 min) and, as
  ``aws-rebalance``, the rebalance recommendation (no deadline: now + ``--preempt-grace``);
* GCP metadata ``instance/preempted`` (``TRUE`` once preempted; GCP grants 30 s);
* Azure Scheduled Events, an event of type ``Preempt`` (deadline = its ``NotBefore``).

The module has two halves: pure parsers, functions of (HTTP status, body, now) that unit tests call
directly, and the I/O at the edge (:class:`MetadataSource` subclasses doing one cheap HTTP request each,
:class:`NoticePoller` calling them from one daemon thread). Metadata services are link-local and answer in
well under a millisecond; a poll every ``--preempt-poll-interval`` (default 2 s, AWS recommends 5 s) costs
nothing measurable. Endpoints can be redirected (tests, proxies) with the ``SPOTRUN_*_METADATA_URL``
variables.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

# The environment names live in elastic.api with the others; re-exported here, where they were first defined.
from elastic.api import ENV_AWS_METADATA_URL as ENV_AWS_METADATA_URL
from elastic.api import ENV_AZURE_METADATA_URL as ENV_AZURE_METADATA_URL
from elastic.api import ENV_GCP_METADATA_URL as ENV_GCP_METADATA_URL
from elastic.api import ENV_PREEMPT_GRACE as ENV_PREEMPT_GRACE
from elastic.api import ENV_PREEMPT_NOTICE as ENV_PREEMPT_NOTICE
from elastic.api import ENV_PREEMPT_POLL_INTERVAL as ENV_PREEMPT_POLL_INTERVAL
from elastic.api import ENV_PREEMPT_SIGNAL as ENV_PREEMPT_SIGNAL
from elastic.api import LaunchConfigError

logger = logging.getLogger(__name__)

AWS_DEFAULT_URL = "http://169.254.169.254"
GCP_DEFAULT_URL = "http://metadata.google.internal"
AZURE_DEFAULT_URL = "http://169.254.169.254"
AZURE_API_VERSION = "2020-07-01"

GCP_PREEMPTION_LEAD = 30.0
"""Seconds GCP gives between the preemption notice and the stop (documented: 30 s)."""

SOURCES = ("aws", "aws-rebalance", "gcp", "azure")
DEFAULT_PREEMPT_GRACE = 30.0
DEFAULT_POLL_INTERVAL = 2.0
HTTP_TIMEOUT = 1.0
"""Seconds one metadata request may take: link-local services answer in microseconds; off-cloud the
address does not route and we must not stall the poller."""


SIGTERM_SOURCE = "sigterm"
"""``Notice.source`` of a SIGTERM to the agent (the one notice that may also insist on a shutdown)."""

@dataclass(frozen=True, slots=True)
class Notice:
    """This node will be taken away at ``deadline`` (wall-clock seconds, ``time.time()``)."""

    source: str
    """``sigterm``, ``signal:SIGUSR2``, ``aws``, ``aws-rebalance``, ``gcp``, ``azure``."""
    deadline: float
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        return {"source": self.source, "deadline": self.deadline, "detail": self.detail}


def earliest(a: Notice | None, b: Notice | None) -> Notice | None:
    """The notice with the earlier deadline (one node has one deadline: the first that binds)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if a.deadline <= b.deadline else b


# --- pure parsers ----------------------------------------------------------------------------------------------


def _iso_to_epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_aws_instance_action(status: int, body: str, now: float) -> Notice | None:
    """``GET /latest/meta-data/spot/instance-action``: 404 until AWS schedules a stop, then
    ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T08:22:00Z"}``."""
    if status == 404:
        return None
    if status != 200:
        raise ValueError(f"unexpected HTTP status {status}")
    data = json.loads(body)
    action, when = str(data["action"]), _iso_to_epoch(str(data["time"]))
    return Notice("aws", when, f"spot instance-action {action} at {data['time']}")


def parse_aws_rebalance(status: int, body: str, now: float, grace: float) -> Notice | None:
    """``GET /latest/meta-data/events/recommendations/rebalance``: 404, or ``{"noticeTime": "..."}``.
    AWS gives no deadline for a rebalance recommendation; we take ``grace`` from now."""
    if status == 404:
        return None
    if status != 200:
        raise ValueError(f"unexpected HTTP status {status}")
    data = json.loads(body)
    return Notice("aws-rebalance", now + grace, f"rebalance recommendation at {data['noticeTime']}")


def parse_gcp_preempted(status: int, body: str, now: float) -> Notice | None:
    """``GET /computeMetadata/v1/instance/preempted`` answers ``TRUE`` or ``FALSE``."""
    if status != 200:
        raise ValueError(f"unexpected HTTP status {status}")
    value = body.strip().upper()
    if value == "FALSE":
        return None
    if value != "TRUE":
        raise ValueError(f"expected TRUE or FALSE, got {body[:40]!r}")
    return Notice("gcp", now + GCP_PREEMPTION_LEAD, "instance/preempted is TRUE")


def parse_azure_events(status: int, body: str, now: float, vm_name: str | None = None) -> Notice | None:
    """Azure Scheduled Events: the earliest ``Preempt`` event (for this VM when ``vm_name`` is known).
    ``NotBefore`` is an RFC 1123 date; empty once the event has started (then: now)."""
    if status != 200:
        raise ValueError(f"unexpected HTTP status {status}")
    found: Notice | None = None
    for event in json.loads(body).get("Events", []):
        if event.get("EventType") != "Preempt":
            continue
        resources = event.get("Resources") or []
        if vm_name is not None and resources and vm_name not in resources:
            continue
        not_before = event.get("NotBefore") or ""
        when = email.utils.parsedate_to_datetime(not_before).timestamp() if not_before else now
        found = earliest(found, Notice("azure", when, f"Scheduled Event {event.get('EventId', '?')} Preempt"))
    return found


def parse_signal_spec(text: str, default_grace: float) -> tuple[signal.Signals, float]:
    """``USR2``, ``SIGUSR2``, ``12`` or ``USR2@120`` (Slurm's ``--signal`` syntax) -> (signal, seconds)."""
    name, _, grace_text = text.strip().partition("@")
    name = name.strip().upper()
    try:
        sig = signal.Signals(int(name)) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError) as exc:
        raise LaunchConfigError(f"--preempt-signal {text!r}: unknown signal {name!r}; use e.g. USR2 or USR2@120") from exc
    if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
        raise LaunchConfigError(f"--preempt-signal {text!r}: {sig.name} cannot be a notice; use e.g. USR1 or USR2")
    grace = default_grace
    if grace_text:
        try:
            grace = float(grace_text)
        except ValueError as exc:
            raise LaunchConfigError(f"--preempt-signal {text!r}: {grace_text!r} is not a number of seconds") from exc
        if grace < 0:
            raise LaunchConfigError(f"--preempt-signal {text!r}: seconds must be >= 0")
    return sig, grace


def notice_signals(preempt_signal: str | None) -> tuple[signal.Signals, ...]:
    """The signals that are a preemption notice to the agent: SIGTERM, and ``--preempt-signal`` when given."""
    found = [signal.SIGTERM]
    if preempt_signal:
        sig, _ = parse_signal_spec(preempt_signal, DEFAULT_PREEMPT_GRACE)
        if sig not in found:
            found.append(sig)
    return tuple(found)


def parse_sources(text: str | None) -> tuple[str, ...]:
    """``aws,gcp`` -> ``("aws", "gcp")``, naming what is accepted when a name is unknown."""
    if not text:
        return ()
    names = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise LaunchConfigError(f"--preempt-notice: unknown source(s) {', '.join(unknown)}; accepted: {', '.join(SOURCES)}")
    return names


# --- I/O: one HTTP request per poll ---------------------------------------------------------------------------


def _request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")


class MetadataSource:
    """One cloud notice source: ``poll(now)`` does the request(s) and returns a notice or None; network
    errors propagate as ``OSError`` (the poller logs them once and keeps polling)."""

    name = ""

    def poll(self, now: float) -> Notice | None:
        raise NotImplementedError


class AwsInstanceAction(MetadataSource):
    """IMDSv2: a session token from ``PUT /latest/api/token``, kept until it expires or is refused."""

    name = "aws"
    path = "/latest/meta-data/spot/instance-action"
    token_ttl = 21600

    def __init__(self, base_url: str | None = None, grace: float = DEFAULT_PREEMPT_GRACE) -> None:
        self.base = (base_url or os.environ.get(ENV_AWS_METADATA_URL) or AWS_DEFAULT_URL).rstrip("/")
        self.grace = grace
        self._token: str | None = None
        self._token_expires = 0.0

    def _get_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_expires:
            status, body = _request(
                self.base + "/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
            )
            if status != 200:
                raise OSError(f"IMDSv2 token request answered HTTP {status}")
            self._token, self._token_expires = body.strip(), time.monotonic() + self.token_ttl - 60
        return self._token

    def _get(self) -> tuple[int, str]:
        status, body = _request(self.base + self.path, headers={"X-aws-ec2-metadata-token": self._get_token()})
        if status == 401:  # token expired or revoked: one fresh token
            self._token = None
            status, body = _request(self.base + self.path, headers={"X-aws-ec2-metadata-token": self._get_token()})
        return status, body

    def poll(self, now: float) -> Notice | None:
        status, body = self._get()
        return parse_aws_instance_action(status, body, now)


class AwsRebalance(AwsInstanceAction):
    name = "aws-rebalance"
    path = "/latest/meta-data/events/recommendations/rebalance"

    def poll(self, now: float) -> Notice | None:
        status, body = self._get()
        return parse_aws_rebalance(status, body, now, self.grace)


class GcpPreempted(MetadataSource):
    name = "gcp"

    def __init__(self, base_url: str | None = None) -> None:
        self.base = (base_url or os.environ.get(ENV_GCP_METADATA_URL) or GCP_DEFAULT_URL).rstrip("/")

    def poll(self, now: float) -> Notice | None:
        status, body = _request(self.base + "/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"})
        return parse_gcp_preempted(status, body, now)


class AzurePreempt(MetadataSource):
    name = "azure"

    def __init__(self, base_url: str | None = None, vm_name: str | None = None) -> None:
        self.base = (base_url or os.environ.get(ENV_AZURE_METADATA_URL) or AZURE_DEFAULT_URL).rstrip("/")
        self.vm_name = vm_name

    def poll(self, now: float) -> Notice | None:
        status, body = _request(
            f"{self.base}/metadata/scheduledevents?api-version={AZURE_API_VERSION}", headers={"Metadata": "true"}
        )
        return parse_azure_events(status, body, now, self.vm_name)


def make_sources(names: Sequence[str], grace: float) -> list[MetadataSource]:
    factories: dict[str, Callable[[], MetadataSource]] = {
        "aws": lambda: AwsInstanceAction(grace=grace),
        "aws-rebalance": lambda: AwsRebalance(grace=grace),
        "gcp": GcpPreempted,
        "azure": AzurePreempt,
    }
    return [factories[name]() for name in names]


class NoticePoller:
    """Polls every source each ``interval`` s on a daemon thread; calls ``on_notice`` once per source, with
    the first notice it reports. A failing source is logged once (off-cloud the address does not route)."""

    def __init__(
        self,
        sources: Sequence[MetadataSource],
        on_notice: Callable[[Notice], None],
        *,
        interval: float = DEFAULT_POLL_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sources = list(sources)
        self._on_notice = on_notice
        self._interval = interval
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()

    def poll_once(self) -> list[Notice]:
        """One round over the sources still silent; returns (and reports) the new notices."""
        found = []
        for source in list(self._sources):
            try:
                notice = source.poll(self._clock())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                if source.name not in self._warned:
                    self._warned.add(source.name)
                    logger.warning("preemption notice source %s is not answering (%s); still polling", source.name, exc)
                continue
            if notice is not None:
                self._sources.remove(source)
                logger.warning("preemption notice from %s: deadline in %.1f s (%s)", notice.source,
                               notice.deadline - self._clock(), notice.detail)
                found.append(notice)
                self._on_notice(notice)
        return found

    def start(self) -> NoticePoller:
        if self._sources and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spotrun-notice-poll", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while self._sources and not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
