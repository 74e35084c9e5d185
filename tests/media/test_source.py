"""Media acquisition: data URLs, HTTP fetch from a local server, the SSRF guard, redirects, caps, timeouts."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import pytest

from ninfer.media.address_policy import AddressPolicy
from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded, MediaFetchFailed, MediaFetchTimeout
from ninfer.media.fetch import FetchPolicy, fetch_media
from ninfer.media.source import Modality, acquire_media, parse_data_url

PNG_MAGIC = b"\x89PNG\r\n\x1a\n" + b"x" * 56
LOCAL = FetchPolicy(addresses=AddressPolicy(allow_private_networks=True))


# -- data URLs ------------------------------------------------------------------------------------


def test_data_url_decodes_base64_with_its_media_type():
    url = "data:image/png;base64," + base64.b64encode(PNG_MAGIC).decode()
    acquired = parse_data_url(url, Modality.IMAGE, max_bytes=1024)
    assert acquired.data == PNG_MAGIC
    assert acquired.media_type == "image/png"
    video = parse_data_url("data:video/mp4;base64,AAAA", Modality.VIDEO, max_bytes=1024)
    assert video.data == b"\x00\x00\x00"


@pytest.mark.parametrize(
    "url, modality",
    [
        ("data:image/png;base64,@@not-base64@@", Modality.IMAGE),
        ("data:image/png;base64,QUJDR", Modality.IMAGE),  # length not a multiple of 4
        ("data:text/plain;base64,QUJD", Modality.IMAGE),  # not an image type
        ("data:image/png;base64,QUJD", Modality.VIDEO),  # an image where a video belongs
        ("data:;base64,QUJD", Modality.IMAGE),  # no type
        ("data:image/;base64,QUJD", Modality.IMAGE),  # no subtype
        ("data:image/png;base64,", Modality.IMAGE),  # empty
        ("data:image/png,rawbytes", Modality.IMAGE),  # not base64
        ("data:image/png;base64", Modality.IMAGE),  # no comma
    ],
)
def test_bad_data_urls_are_invalid_media(url, modality):
    with pytest.raises(InvalidMedia) as caught:
        parse_data_url(url, modality, max_bytes=1024)
    assert caught.value.code == "invalid_media"
    assert "QUJD" not in caught.value.message  # payloads never echo back


def test_data_url_above_byte_cap_is_a_budget_error():
    url = "data:image/png;base64," + base64.b64encode(b"y" * 3000).decode()
    with pytest.raises(MediaBudgetExceeded):
        parse_data_url(url, Modality.IMAGE, max_bytes=2999)
    assert len(parse_data_url(url, Modality.IMAGE, max_bytes=3000).data) == 3000


def test_other_schemes_are_invalid_media():
    for url in ("file:///etc/passwd", "ftp://example.com/a.png", "just text"):
        with pytest.raises(InvalidMedia):
            asyncio.run(acquire_media(url, Modality.IMAGE, FetchPolicy()))


# -- a local HTTP server --------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/image.png":
            self._send(200, PNG_MAGIC)
        elif path.startswith("/hop/"):
            remaining = int(path.rsplit("/", 1)[1])
            target = "/image.png" if remaining == 0 else f"/hop/{remaining - 1}"
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://internal.test/latest/meta-data")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/big":
            self._send(200, b"z" * 5000)
        elif path == "/big-undeclared":
            self.send_response(200)
            self.end_headers()  # no length: the body ends when the connection closes
            self.wfile.write(b"z" * 5000)
            self.close_connection = True
        elif path == "/slow":
            time.sleep(1.0)
            self._send(200, PNG_MAGIC)
        elif path == "/host":
            self._send(200, self.headers["Host"].encode())
        else:
            self._send(404, b"missing")

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_loopback_fetch_works_only_with_the_private_network_opt_in(server):
    assert asyncio.run(fetch_media(server + "/image.png?token=secret", LOCAL)) == PNG_MAGIC
    with pytest.raises(MediaFetchFailed) as caught:
        asyncio.run(fetch_media(server + "/image.png?token=secret", FetchPolicy()))
    assert caught.value.code == "media_fetch_failed"
    assert "loopback" in caught.value.message
    assert "secret" not in caught.value.message


def test_connection_goes_to_the_checked_address_with_the_original_host(server):
    port = server.rsplit(":", 1)[1]
    resolved = []

    async def resolver(host, port_number):
        resolved.append(host)
        return ["127.0.0.1"]

    body = asyncio.run(fetch_media(f"http://media.test:{port}/host", LOCAL, resolver))
    assert body == f"media.test:{port}".encode()
    assert resolved == ["media.test"]  # resolved once, never again by the HTTP client


def test_redirects_are_followed_up_to_the_limit(server):
    policy = FetchPolicy(max_redirects=3, addresses=AddressPolicy(allow_private_networks=True))
    assert asyncio.run(fetch_media(server + "/hop/2", policy)) == PNG_MAGIC  # three redirects
    with pytest.raises(MediaFetchFailed) as caught:
        asyncio.run(fetch_media(server + "/hop/3", policy))  # four
    assert "redirects" in caught.value.message


def test_each_redirect_target_is_checked(server):
    port = server.rsplit(":", 1)[1]
    resolved = []

    async def resolver(host, port_number):
        resolved.append(host)
        return {"public.test": ["127.0.0.1"], "internal.test": ["169.254.169.254"]}[host]

    # Metadata stays refused even with the opt-in; the check happens before any connection to it.
    with pytest.raises(MediaFetchFailed) as caught:
        asyncio.run(fetch_media(f"http://public.test:{port}/to-metadata", LOCAL, resolver))
    assert "metadata" in caught.value.message
    assert resolved == ["public.test", "internal.test"]


@pytest.mark.parametrize("url", ["HtTps://\x8b/a.png", "http://a..b/x", "https://" + "x" * 64 + ".test/"])
def test_a_host_no_resolver_can_encode_is_invalid_media(url):
    """Found by fuzzing a --vision server: a control character in the host made the resolver's IDNA
    encoding raise UnicodeError, which surfaced as a 500."""
    with pytest.raises(InvalidMedia) as caught:
        asyncio.run(fetch_media(url, FetchPolicy()))
    assert caught.value.code == "invalid_media" and "host" in caught.value.message


def test_http_errors_and_size_caps(server):
    with pytest.raises(MediaFetchFailed) as caught:
        asyncio.run(fetch_media(server + "/missing", LOCAL))
    assert "404" in caught.value.message
    capped = FetchPolicy(max_bytes=4999, addresses=AddressPolicy(allow_private_networks=True))
    with pytest.raises(MediaBudgetExceeded):
        asyncio.run(fetch_media(server + "/big", capped))
    with pytest.raises(MediaBudgetExceeded):
        asyncio.run(fetch_media(server + "/big-undeclared", capped))
    roomy = FetchPolicy(max_bytes=5000, addresses=AddressPolicy(allow_private_networks=True))
    assert len(asyncio.run(fetch_media(server + "/big-undeclared", roomy))) == 5000


def test_read_and_total_timeouts(server):
    read = FetchPolicy(read_timeout_s=0.2, addresses=AddressPolicy(allow_private_networks=True))
    with pytest.raises(MediaFetchTimeout) as caught:
        asyncio.run(fetch_media(server + "/slow", read))
    assert caught.value.code == "media_fetch_timeout"
    total = FetchPolicy(total_timeout_s=0.2, addresses=AddressPolicy(allow_private_networks=True))
    with pytest.raises(MediaFetchTimeout):
        asyncio.run(fetch_media(server + "/slow", total))


# -- the address policy with an injected resolver (nothing is contacted) --------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.254",
        "192.168.1.1",
        "169.254.1.1",
        "169.254.169.254",
        "fd00:ec2::254",
        "fc00::1",
        "fd12:3456::1",
        "fe80::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "0.0.0.0",
        "::",
        "100.64.0.1",  # carrier-grade NAT
    ],
)
def test_non_public_addresses_are_refused_after_resolution(address):
    async def resolver(host, port):
        return [address]

    with pytest.raises(MediaFetchFailed) as caught:
        asyncio.run(fetch_media("http://innocent.example/a.png?sig=abc", FetchPolicy(), resolver))
    assert "innocent.example" in caught.value.message
    assert "sig=abc" not in caught.value.message


def test_one_refused_answer_among_public_ones_refuses_the_host():
    async def resolver(host, port):
        return ["93.184.216.34", "10.0.0.7"]

    with pytest.raises(MediaFetchFailed):
        asyncio.run(fetch_media("http://mixed.example/a.png", FetchPolicy(), resolver))


def test_literal_addresses_are_checked_too():
    for url in ("http://169.254.169.254/latest/meta-data", "http://[::1]:8080/x", "http://10.0.0.1/x"):
        with pytest.raises(MediaFetchFailed):
            asyncio.run(fetch_media(url, FetchPolicy()))


def test_opt_in_admits_private_ranges_but_never_metadata_or_unspecified():
    opted = AddressPolicy(allow_private_networks=True)
    import ipaddress

    for allowed in ("127.0.0.1", "10.0.0.1", "192.168.0.2", "fc00::1", "169.254.1.1"):
        assert opted.refusal(ipaddress.ip_address(allowed)) is None
    for refused in ("169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254", "0.0.0.0", "::", "224.0.0.1"):
        assert opted.refusal(ipaddress.ip_address(refused)) is not None
    assert AddressPolicy().refusal(ipaddress.ip_address("93.184.216.34")) is None
    assert AddressPolicy().refusal(ipaddress.ip_address("2606:2800:220:1::1")) is None
