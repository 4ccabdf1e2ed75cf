"""Finding main on the LAN by mDNS, for `odmoe-launch join=auto:SECRET` (optional, off by default).

Contract: `advertise(name, host, port, fingerprint)` announces main's join door as a
`_odmoe-join._tcp.local.` service whose TXT record carries the certificate's fingerprint, and
returns a handle whose `close()` withdraws it; `find_mains(timeout_s)` returns every such door in
sight as `FoundMain(name, host, port, fingerprint)`. Nothing found here is trusted: a box still
checks the certificate against the advertised fingerprint, and main must prove it holds the
cluster's secret (odmoe.transport.join_link.main_proof) before the box sends anything of its own.
Needs the `lan` extra (zeroconf); without it both raise `DiscoveryUnavailable` saying so.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

SERVICE = "_odmoe-join._tcp.local."


class DiscoveryUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class FoundMain:
    name: str
    host: str
    port: int
    fingerprint: str


def _zeroconf():
    try:
        import zeroconf
    except ImportError:
        raise DiscoveryUnavailable(
            "finding main by mDNS needs the `lan` extra: pip install 'odmoe[lan]' (or give the link)"
        ) from None
    return zeroconf


class Advertised:
    def __init__(self, zc, info):
        self._zc, self._info = zc, info

    def close(self) -> None:
        self._zc.unregister_service(self._info)
        self._zc.close()


def advertise(name: str, host: str, port: int, fingerprint: str) -> Advertised:
    zeroconf = _zeroconf()
    zc = zeroconf.Zeroconf()
    info = zeroconf.ServiceInfo(
        SERVICE,
        f"{name}.{SERVICE}",
        addresses=[socket.inet_aton(host)],
        port=port,
        properties={"fp": fingerprint},
    )
    zc.register_service(info)
    return Advertised(zc, info)


def find_mains(timeout_s: float = 2.0) -> list[FoundMain]:
    zeroconf = _zeroconf()
    zc = zeroconf.Zeroconf()
    names: list[str] = []

    class Listener:
        def add_service(self, _zc, _type, name):
            names.append(name)

        def update_service(self, *_):
            pass

        def remove_service(self, *_):
            pass

    try:
        browser = zeroconf.ServiceBrowser(zc, SERVICE, Listener())
        time.sleep(timeout_s)
        browser.cancel()
        found = []
        for name in dict.fromkeys(names):
            info = zc.get_service_info(SERVICE, name, timeout=1000)
            if info is None or not info.parsed_addresses():
                continue
            fp = (info.properties or {}).get(b"fp", b"").decode()
            found.append(
                FoundMain(name.removesuffix("." + SERVICE), info.parsed_addresses()[0], info.port, fp)
            )
        return sorted(found, key=lambda f: f.name)
    finally:
        zc.close()
