"""EtcdRendezvousConfig from torch's RendezvousParameters, and the registry plumbing (no server)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as torch_registry

from elastic.rendezvous import registry
from elastic.rendezvous.api import EtcdRendezvousConfig, RendezvousConfigError, RendezvousError, parse_endpoints

pytestmark = pytest.mark.timeout(20)


def params(endpoint: str = "127.0.0.1:2379", min_nodes: int = 1, max_nodes: int = 2, **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id="job1", min_nodes=min_nodes, max_nodes=max_nodes, **conf
    )


def test_defaults() -> None:
    cfg = EtcdRendezvousConfig.from_parameters(params())
    assert cfg.lease_ttl == 3 and cfg.join_timeout == 600 and cfg.last_call_timeout == 1.0
    assert cfg.rejoin_timeout == 30.0 and cfg.close_timeout == 30.0
    assert cfg.etcd_prefix == "/spotrun/rdzv" and cfg.etcd_timeout == 30
    assert cfg.run_prefix == "/spotrun/rdzv/job1/"
    assert cfg.endpoints == (("127.0.0.1", 2379),)
    assert cfg.finished_ttl == 0, "the finished marker is opt-in"
    assert EtcdRendezvousConfig.from_parameters(params(finished_ttl="86400")).finished_ttl == 86400


def test_string_values_from_rdzv_conf_are_parsed() -> None:
    cfg = EtcdRendezvousConfig.from_parameters(
        params(lease_ttl="2", join_timeout="30", last_call_timeout="0.5", etcd_prefix="/x/", etcd_timeout="5")
    )
    assert (cfg.lease_ttl, cfg.join_timeout, cfg.last_call_timeout, cfg.etcd_prefix, cfg.etcd_timeout) == (
        2, 30.0, 0.5, "/x", 5.0
    )


def test_torch_injected_keys_are_accepted() -> None:
    """torch's LaunchConfig always adds timeout=900; other torch backends' keys must not break us."""
    cfg = EtcdRendezvousConfig.from_parameters(params(timeout=900, is_host="1", read_timeout="60", rank=0))
    assert cfg.join_timeout == 600


def test_unknown_key_is_named_with_accepted_list() -> None:
    with pytest.raises(RendezvousConfigError) as info:
        EtcdRendezvousConfig.from_parameters(params(lease_tll="3"))
    message = str(info.value)
    assert "'lease_tll'" in message and "lease_ttl" in message and "join_timeout" in message


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"lease_ttl": "0"}, "lease_ttl"),
        ({"lease_ttl": "1.5"}, "whole number"),
        ({"join_timeout": "soon"}, "join_timeout"),
        ({"etcd_timeout": "-1"}, "etcd_timeout"),
        ({"last_call_timeout": "-1"}, "last_call_timeout"),
        ({"rejoin_timeout": "-1"}, "rejoin_timeout"),
        ({"etcd_prefix": "relative"}, "etcd_prefix"),
        ({"cert": "/c.pem"}, "key"),
        ({"user": "u"}, "password"),
        ({"ca_cert": "/a", "cacert": "/b"}, "both"),
        ({"finished_ttl": "-1"}, r"finished_ttl must be a whole number of seconds from 0 \(off\)"),
        ({"finished_ttl": "9000000001"}, "etcd's longest lease"),
        ({"finished_ttl": "1.5"}, "finished_ttl='1.5' must be a whole number"),
        ({"finished_ttl": "inf"}, "finished_ttl='inf' must be a whole number"),  # was an OverflowError
        ({"lease_ttl": "inf"}, "lease_ttl='inf' must be a whole number"),
        ({"finished_ttl": "yes"}, "finished_ttl='yes' is not a number"),
    ],
)
def test_bad_values_are_rejected_clearly(conf: dict[str, object], match: str) -> None:
    with pytest.raises(RendezvousConfigError, match=match):
        EtcdRendezvousConfig.from_parameters(params(**conf))


def test_min_greater_than_max_is_rejected() -> None:
    # torch's RendezvousParameters already refuses it; our config refuses it on its own too.
    with pytest.raises(ValueError, match="maximum number"):
        params(min_nodes=3, max_nodes=2)
    with pytest.raises(RendezvousConfigError, match=r"max_nodes \(2\) must be >= min_nodes \(3\)"):
        EtcdRendezvousConfig(run_id="j", endpoints=(("h", 1),), min_nodes=3, max_nodes=2)


def test_config_error_is_a_rendezvous_error_and_value_error() -> None:
    assert issubclass(RendezvousConfigError, RendezvousError) and issubclass(RendezvousConfigError, ValueError)


def test_endpoints_parsing() -> None:
    assert parse_endpoints("http://a:1,b,[::1]:3") == (("a", 1), ("b", 2379), ("::1", 3))
    with pytest.raises(RendezvousConfigError, match="bad port"):
        parse_endpoints("a:xx")
    with pytest.raises(RendezvousConfigError, match="--rdzv-endpoint"):
        parse_endpoints("")


def test_aliases_of_torch_etcd_v2_backend() -> None:
    cfg = EtcdRendezvousConfig.from_parameters(params(ca_cert="/ca", ssl_cert="/c", ssl_cert_key="/k"))
    assert (cfg.cacert, cfg.cert, cfg.key) == ("/ca", "/c", "/k")


def test_register_is_idempotent_and_entry_point_factory_returns_creator() -> None:
    registry.register()
    registry.register()
    assert torch_registry._registry["etcd-v3"] is registry.create_handler
    assert registry.handler_factory() is registry.create_handler


def test_create_handler_validates_params() -> None:
    with pytest.raises(RendezvousConfigError, match="bogus"):
        registry.create_handler(params(bogus=1))
