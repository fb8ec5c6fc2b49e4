"""gloo (and NCCL) bind to the interface that carries Ray's node address (workers/bind.py, issue 35).
The wiring with a host name that resolves to 127.0.1.1 is tests/process/test_gloo_binding.py."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest

from workers import bind

ADDRS = {
    "lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1"),
           SimpleNamespace(family=socket.AF_INET6, address="::1")],
    "eth0": [SimpleNamespace(family=getattr(socket, "AF_PACKET", 17), address="52:54:00:12:34:56"),
             SimpleNamespace(family=socket.AF_INET, address="198.18.0.3"),
             SimpleNamespace(family=socket.AF_INET6, address="fe80::1%eth0")],
    "br-hosts": [SimpleNamespace(family=socket.AF_INET, address="198.18.0.1")],
}


@pytest.mark.parametrize(("ip", "name"), [("198.18.0.3", "eth0"), ("198.18.0.1", "br-hosts"), ("127.0.0.1", "lo"),
                                          ("fe80::1", "eth0"), ("198.18.0.9", None), ("127.0.1.1", None)])
def test_the_interface_is_the_one_holding_the_address(ip, name):
    assert bind.interface_of(ip, ADDRS) == name


def test_this_hosts_loopback_is_found():
    assert bind.interface_of("127.0.0.1") is not None


def test_groups_made_within_bind_to_it_and_the_setting_is_gone_after(monkeypatch):
    monkeypatch.delenv(bind.GLOO_IFNAME, raising=False)
    monkeypatch.setattr(bind, "interface_of", lambda ip, addresses=None: {"198.18.0.3": "eth0"}.get(ip))
    with bind.bound_groups("198.18.0.3") as name:
        assert name == "eth0" and os.environ[bind.GLOO_IFNAME] == "eth0"
    assert bind.GLOO_IFNAME not in os.environ
    with bind.bound_groups(None) as name:  # outside Ray (spawned-process tests): gloo's own choice
        assert name is None and bind.GLOO_IFNAME not in os.environ


def test_an_address_on_no_interface_leaves_gloo_its_choice(monkeypatch, caplog):
    monkeypatch.delenv(bind.GLOO_IFNAME, raising=False)
    monkeypatch.setattr(bind, "interface_of", lambda ip, addresses=None: None)
    with bind.bound_groups("203.0.113.7") as name:
        assert name is None and bind.GLOO_IFNAME not in os.environ
    assert "203.0.113.7 is on no interface" in caplog.text


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv(bind.GLOO_IFNAME, "ib0")
    monkeypatch.setenv(bind.NCCL_IFNAME, "ib0")
    monkeypatch.setattr(bind, "interface_of", lambda ip, addresses=None: "eth0")
    with bind.bound_groups("198.18.0.3") as name:
        assert name is None and os.environ[bind.GLOO_IFNAME] == "ib0"
    assert os.environ[bind.GLOO_IFNAME] == "ib0"
    bind.nccl_interface("198.18.0.3")
    assert os.environ[bind.NCCL_IFNAME] == "ib0"


def test_nccl_gets_the_interface_unless_set(monkeypatch):
    monkeypatch.delenv(bind.NCCL_IFNAME, raising=False)
    monkeypatch.setattr(bind, "interface_of", lambda ip, addresses=None: "eth0")
    bind.nccl_interface("198.18.0.3")
    assert os.environ[bind.NCCL_IFNAME] == "eth0"
