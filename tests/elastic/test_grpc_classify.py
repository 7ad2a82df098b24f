"""grpc failures classified by what they are (issue 16): the status code first, TLS only in grpc's TLS layer's
own words. The details strings are the exact ones grpc 1.x printed here for each kind of failure (collected
against a real etcd, a TLS etcd, a closed port and a link cut by a blackhole qdisc in a network namespace)."""

from __future__ import annotations

import grpc
import pytest

from elastic.rendezvous.etcd_client import Failure, classify, tls_mismatch
from tests.elastic.test_rendezvous_etcd import make_config

U = grpc.StatusCode.UNAVAILABLE
_LAST = "failed to connect to all addresses; last error: "

CASES = [
    # what happened, code, details, classification
    ("TCP connect refused", U,
     _LAST + "UNKNOWN: ipv4:127.0.0.1:36525: Failed to connect to remote host: Connection refused", Failure.TRANSIENT),
    ("connect timeout (SYN dropped)", U,
     _LAST + "UNKNOWN: ipv4:10.231.7.10:2379: tcp handshaker shutdown", Failure.TRANSIENT),
    ("dropped link, call in flight", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", Failure.TRANSIENT),
    ("dropped link, stream timed out", U, "Stream removed (recvmsg:Connection timed out (110))", Failure.TRANSIENT),
    ("wrong CA", U,
     _LAST + "UNKNOWN: ipv4:127.0.0.1:41431: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
     "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
     "certificate: OK", Failure.TLS),
    ("missing client certificate", U,
     _LAST + "UNKNOWN: ipv4:127.0.0.1:55371: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
     "error:10000412:SSL routines:OPENSSL_internal:SSLV3_ALERT_BAD_CERTIFICATE: OK", Failure.TLS),
    ("plaintext client, TLS etcd", U, _LAST + "UNAVAILABLE: ipv4:127.0.0.1:41431: Socket closed",
     Failure.MAYBE_TLS_MISMATCH),
    ("TLS client, plaintext etcd", U,
     _LAST + "UNAVAILABLE: ipv4:127.0.0.1:43619: Handshake read failed (Endpoint closing)", Failure.MAYBE_TLS_MISMATCH),
    ("etcd electing a leader", U, "etcdserver: no leader", Failure.TRANSIENT),
    ("permission denied", grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", Failure.PERMANENT),
    ("bad request", grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided", Failure.PERMANENT),
]  # fmt: skip


@pytest.mark.parametrize(("what", "code", "details", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_failure_is_classified_by_what_it_is(what: str, code: grpc.StatusCode, details: str, expected: Failure) -> None:
    assert classify(code, details) is expected, what


def test_the_word_handshake_alone_is_not_tls() -> None:
    """The regression: a partition ("tcp handshaker shutdown") was taken for a certificate problem."""
    assert classify(U, "tcp handshaker shutdown") is Failure.TRANSIENT
    assert classify(U, "handshake") is Failure.TRANSIENT


def test_tls_words_count_only_for_unavailable() -> None:
    assert classify(grpc.StatusCode.DEADLINE_EXCEEDED, "Tls handshake failed") is Failure.TRANSIENT
    assert classify(grpc.StatusCode.PERMISSION_DENIED, "certificate_verify_failed") is Failure.PERMANENT


def test_a_probe_settles_a_mismatch_only_with_a_positive_answer() -> None:
    plain, tls = make_config("127.0.0.1:1"), make_config("127.0.0.1:1", cacert="/ca.pem")
    assert tls_mismatch(plain, "tls") and tls_mismatch(tls, "plaintext")
    assert not tls_mismatch(plain, "plaintext") and not tls_mismatch(tls, "tls")
    assert not tls_mismatch(plain, None) and not tls_mismatch(tls, None)
