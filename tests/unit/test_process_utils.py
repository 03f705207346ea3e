"""Which network interface holds an address: what a Ray worker binds gloo to."""

from __future__ import annotations

from engine.process.process_utils import interface_with_address, loopback_interface


def test_the_loopback_address_is_on_the_loopback_interface():
    assert interface_with_address("127.0.0.1") == loopback_interface()


def test_an_address_no_interface_holds_has_none():
    assert interface_with_address("198.51.100.7") is None  # TEST-NET-2: never assigned here
