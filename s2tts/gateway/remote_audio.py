"""`ref_audio` as vLLM-Omni takes it: a base64 data URL, an http(s) URL or a `file://` path -> the file's bytes.

A server that fetches what its clients name is a door into the network behind it, so URLs are off by default and
the operator opens them (GatewayConfig: `ref_audio_hosts`, `ref_audio_dir`, `ref_audio_timeout_s`,
`max_upload_bytes`):

- http(s): the URL must match an entry of `ref_audio_hosts`: a host name (`cdn.example.com`, or with a port), an IP
  address or network (`10.1.2.3`, `10.0.0.0/8`, with a port or not), or a URL prefix (`https://cdn.example.com/voices/`:
  scheme, host, port, and a path that ends at a `/`).
- Every address the host resolves to must be public (`ipaddress`' `is_global`, not multicast) unless an IP address or
  network of the list (an entry, or the host of one) holds it: a listed name that resolves to a private address is
  refused until that address is listed too. The name is resolved once, checked, and the connection goes to the
  checked address (the request keeps the name in `Host` and for TLS), so no second DNS answer is ever used.
  No proxy from the environment is used.
- Redirects (at most `MAX_REDIRECTS`) are followed only to http(s) URLs that pass the same checks.
- At most `max_upload_bytes` (the `Content-Length`, then the bytes as they come), and the whole fetch, redirects and
  body, within `ref_audio_timeout_s`.
- `file://` (`file:///path` or `file://localhost/path`): a regular file under `ref_audio_dir` once symlinks and `..`
  are resolved, at most `max_upload_bytes`.

The bytes are then checked as an uploaded file is (decoded, the reference's length: app.py). httpx does the HTTP;
what is written here is the policy it has no notion of: the allow-list, the address check, where redirects may go.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import anyio
import httpx

from .audio_io import decode_data_url
from .error_bodies import APIError, bad_request
from .options import GatewayConfig

MAX_REDIRECTS = 5
_DEFAULT_PORT = {"http": 80, "https": 443}
_HOSTS, _DIR, _TIMEOUT = "--ref-audio-hosts", "--ref-audio-dir", "--ref-audio-timeout"

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class _Rule:
    """One entry of the allow-list."""

    host: str | None = None  # a host name (lower case); None: `net` names the hosts
    net: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    port: int | None = None  # None: any
    scheme: str | None = None  # a URL prefix's
    path: str | None = None  # a URL prefix's path (the URL's is it, or under it)

    def matches(self, scheme: str, host: str, ip: IP | None, port: int, path: str) -> bool:
        if (self.scheme and self.scheme != scheme) or (self.port is not None and self.port != port):
            return False
        if self.net is not None:
            if ip is None or ip not in self.net:
                return False
        elif self.host != host:
            return False
        return self.path is None or path == self.path or path.startswith(self.path.rstrip("/") + "/")


def _ip(host: str) -> IP | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def parse_rule(entry: str) -> _Rule:
    """An entry of `ref_audio_hosts` (see the module's doc); ValueError when it is none of the forms."""
    e = entry.strip()
    prefix = "://" in e
    if not prefix:
        try:  # an address or a network: any port
            return _Rule(net=ipaddress.ip_network(e, strict=False))
        except ValueError:
            pass
    u = urlsplit(e if prefix else "//" + e)
    try:
        host, port = (u.hostname or "").lower(), u.port
    except ValueError:
        raise ValueError(f"ref-audio host entry {entry!r} has a bad port") from None
    if not host or u.username or u.password or u.query or u.fragment or (not prefix and u.path):
        raise ValueError(f"ref-audio host entry {entry!r}: give a host name, an IP address or network, or a URL prefix "
                         "such as https://cdn.example.com/voices/")
    if prefix:
        if u.scheme not in _DEFAULT_PORT:
            raise ValueError(f"ref-audio host entry {entry!r}: a URL prefix is http:// or https://")
        port = port or _DEFAULT_PORT[u.scheme]
    ip = _ip(host)
    return _Rule(host=None if ip else host, net=ipaddress.ip_network(ip) if ip else None, port=port,
                 scheme=u.scheme if prefix else None, path=(u.path or "/") if prefix else None)


def _refused(message: str, setting: str) -> APIError:
    return bad_request(f"ref_audio: {message}; the operator allows it with {setting} (docs/GATEWAY.md), or send the "
                       "clip itself as a base64 data URL (data:audio/wav;base64,...)", "ref_audio",
                       code="ref_audio_not_allowed")


def _failed(message: str) -> APIError:
    return bad_request(f"ref_audio: {message}", "ref_audio", code="ref_audio_unavailable")


class RemoteAudio:
    """Reads `ref_audio` values under the operator's settings (built once from the config)."""

    def __init__(self, cfg: GatewayConfig):
        self.rules = [parse_rule(e) for e in cfg.ref_audio_hosts if e.strip()]
        self.nets = [r.net for r in self.rules if r.net is not None]
        self.dir = Path(cfg.ref_audio_dir).resolve() if cfg.ref_audio_dir else None
        self.limit = cfg.max_upload_bytes
        self.timeout_s = cfg.ref_audio_timeout_s

    async def read(self, value: str, param: str = "ref_audio") -> bytes:
        """A `ref_audio` value -> the bytes of its file (APIError naming what to change)."""
        scheme = value.strip().split(":", 1)[0].lower() if "://" in value[:16] else ""
        if scheme in _DEFAULT_PORT:
            return await self._http(value.strip(), param)
        if scheme == "file":
            return await anyio.to_thread.run_sync(self._file, value.strip(), param)
        return decode_data_url(value, param)

    def _too_large(self, param: str, what: str) -> APIError:
        return APIError(413, f"{param}: {what} is larger than {self.limit / 2**20:.1f} MiB, the limit for audio files "
                             "(--max-upload-mb): send a shorter or smaller file", param=param, code="payload_too_large")

    # ---- file:// ---------------------------------------------------------------------------------------------------
    def _file(self, value: str, param: str) -> bytes:
        if self.dir is None:
            raise _refused("file:// paths are not read by this server", _DIR)
        u = urlsplit(value)
        if u.netloc not in ("", "localhost") or u.query or u.fragment:
            raise bad_request(f"{param}: a file URL is file:///absolute/path (no host, query or fragment)", param)
        path = Path(unquote(u.path)).resolve()
        if not path.is_relative_to(self.dir):
            raise _refused(f"{unquote(u.path)} is outside the directory this server reads references from", _DIR)
        if not path.is_file():
            raise _failed(f"{unquote(u.path)} is not a file")
        with open(path, "rb") as f:
            data = f.read(self.limit + 1)
        if len(data) > self.limit:
            raise self._too_large(param, unquote(u.path))
        return data

    # ---- http(s) ---------------------------------------------------------------------------------------------------
    def _check_url(self, url: str) -> tuple:
        """-> (split URL, host, port, IP if the host is one); refused unless the list allows the URL."""
        u = urlsplit(url)
        if u.scheme not in _DEFAULT_PORT:
            raise _refused(f"{url[:200]} is not an http(s) URL", _HOSTS)
        try:
            host, port = (u.hostname or "").lower(), u.port or _DEFAULT_PORT[u.scheme]
        except ValueError:
            raise bad_request(f"ref_audio: {url[:200]} has a bad port", "ref_audio") from None
        if not host:
            raise bad_request(f"ref_audio: {url[:200]} has no host", "ref_audio")
        if u.username or u.password:
            raise bad_request("ref_audio: a URL with credentials (user:password@) is not fetched", "ref_audio")
        ip = _ip(host)
        if not self.rules:
            raise _refused("http(s) URLs are not fetched by this server", _HOSTS)
        if not any(r.matches(u.scheme, host, ip, port, u.path or "/") for r in self.rules):
            raise _refused(f"{u.scheme}://{u.netloc}{u.path[:120]} is not among the URLs this server fetches", _HOSTS)
        return u, host, port, ip

    async def _address(self, host: str, port: int, ip: IP | None) -> IP:
        """The address to connect to: the host's (resolved once), each checked as the module's doc says."""
        if ip is not None:
            found = [ip]
        else:
            try:
                infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                raise _failed(f"the host {host!r} could not be resolved ({e})") from None
            found = list(dict.fromkeys(_ip(str(i[4][0])) for i in infos))
        for a in found:
            if (not a.is_global or a.is_multicast) and not any(a in n for n in self.nets if n.version == a.version):
                raise _refused(f"{host} is at {a}, a private, loopback or reserved address, which is fetched only "
                               "when that address or its network is listed", _HOSTS)
        return found[0]

    async def _http(self, url: str, param: str) -> bytes:
        try:
            with anyio.fail_after(self.timeout_s):
                async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=None) as client:
                    for _ in range(MAX_REDIRECTS + 1):
                        u, host, port, ip = self._check_url(url)
                        addr = await self._address(host, port, ip)
                        netloc = f"[{addr}]" if addr.version == 6 else str(addr)
                        target = f"{u.scheme}://{netloc}:{port}{u.path or '/'}" + (f"?{u.query}" if u.query else "")
                        async with client.stream("GET", target, headers={"Host": u.netloc},
                                                 extensions={"sni_hostname": host}) as r:
                            if r.status_code in (301, 302, 303, 307, 308) and "location" in r.headers:
                                url = urljoin(url, r.headers["location"])
                                continue
                            if r.status_code != 200:
                                raise _failed(f"GET {url[:200]} answered {r.status_code}: give a URL that serves the "
                                              "audio file")
                            return await self._body(r, url, param)
                    raise _failed(f"more than {MAX_REDIRECTS} redirects from {url[:200]}")
        except TimeoutError:
            raise _failed(f"fetching the audio took longer than {self.timeout_s:g} s (the limit, {_TIMEOUT}): give a "
                          "URL that answers faster, or send the clip itself") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise _failed(f"fetching {url[:200]} failed ({type(e).__name__}: {e})") from None

    async def _body(self, r: httpx.Response, url: str, param: str) -> bytes:
        try:
            length = int(r.headers.get("content-length", "0"))
        except ValueError:
            length = 0
        if length > self.limit:
            raise self._too_large(param, f"the file at {url[:200]}")
        data = bytearray()
        async for piece in r.aiter_bytes():  # decoded (gzip ...) as it comes: the limit is on the file
            data += piece
            if len(data) > self.limit:
                raise self._too_large(param, f"the file at {url[:200]}")
        return bytes(data)
