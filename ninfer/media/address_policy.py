"""Which resolved addresses a media fetch may connect to (the SSRF guard).

By default only globally routable unicast addresses are allowed. The private-network opt-in also
admits loopback, RFC 1918, link-local, unique-local and similar ranges; cloud metadata endpoints,
unspecified and multicast addresses stay refused either way.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Instance-metadata services (AWS/GCP/Azure/OCI, AWS IPv6, AWS ECS task role, Alibaba Cloud).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(text)
    for text in ("169.254.169.254", "fd00:ec2::254", "169.254.170.2", "169.254.170.23", "100.100.100.200")
)
# NAT64 well-known prefix: the low 32 bits are an IPv4 address the gateway will reach.
NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries for routing (mapped, NAT64, 6to4, Teredo), if any."""
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


@dataclass(frozen=True)
class AddressPolicy:
    allow_private_networks: bool = False

    def refusal(self, address: IPAddress) -> str | None:
        """Why connecting to `address` is refused, or None when it is allowed."""
        inner = embedded_ipv4(address)
        if inner is not None:
            reason = self.refusal(inner)
            if reason is not None:
                return reason
        if address in METADATA_ADDRESSES:
            return "a cloud metadata address"
        if address.is_unspecified:
            return "an unspecified address"
        if address.is_multicast:
            return "a multicast address"
        if self.allow_private_networks:
            return None
        if address.is_loopback:
            return "a loopback address"
        if address.is_link_local:
            return "a link-local address"
        if address.is_private or not address.is_global:
            return "a private or non-public address"
        return None
