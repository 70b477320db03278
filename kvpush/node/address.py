"""The control port's two addresses: the one it listens on and the one peers are told.

`host` is advertised: it goes into this node's Hello, push registrations and cancels
(where prefill sends its notices back) and pull coordinates (where decode connects), so
it must be an address the other machines can reach. `bind_host` is what the control
server listens on; it defaults to `host`, and differs behind NAT or a port mapping (listen
on 0.0.0.0 or a private address, advertise the public one).
"""

from __future__ import annotations

import errno
import ipaddress

WILDCARDS = ("", "*", "0", "0.0.0.0", "::", "[::]")


def check_advertised(host: str) -> None:
    """Raise ValueError unless `host` is an address a peer can connect to."""
    try:
        unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        unspecified = host.strip() in WILDCARDS
    if unspecified:
        anywhere = "::" if ":" in host else "0.0.0.0"
        raise ValueError(
            f"kvpush's host (kv_connector_extra_config.host, or VLLM_NIXL_SIDE_CHANNEL_HOST) "
            f"is {host!r}, which peers cannot connect to: host is the address advertised to "
            "the other servers, an address of this machine they reach; to listen on every "
            f"interface set bind_host to {anywhere!r} and host to that reachable address"
        )


def listen_failed(exc: OSError, bind_host: str, host: str) -> OSError:
    """`exc` from listening on bind_host, with what to change when the address is not
    this machine's (a peer's address, or a public address behind NAT)."""
    if exc.errno != errno.EADDRNOTAVAIL:
        return exc
    if bind_host == host:
        hint = (
            f"{host} is not an address of this machine; if peers reach it at {host} "
            "through NAT, keep host and set bind_host to a local address or 0.0.0.0"
        )
    else:
        hint = f"bind_host {bind_host} is not an address of this machine"
    return OSError(exc.errno, f"{exc.strerror}; {hint}")
