"""Image URIs a tenant writes in a chat line (issue 33, findings 2 and 6): they are parsed, not
prefix-matched, and can neither steer the store, leave the allowed prefix, nor make the server
or a worker reach a private address.

s3:// probes run against a real S3-compatible server (moto); http(s) probes against local
servers that record every request they get, so "refused" means no request reached them, not
only an error text. Validation is driven through `read_row_chunks` (what the server's batch
create and `batchllm submit` run) and `parse_line`; the worker's read through `open_image(url,
decode=False, settings=get_settings())`, the call engine/images.py makes when it prepares a row.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm.input.images import ImageProblem, open_image, shown
from batchllm.input.validation.validate import LineProblem, parse_line, read_row_chunks
from batchllm.settings import get_settings
from batchllm.store.models import job_id_of
from tests.support.inputs import source_of
from tests.support.s3server import S3Server, moto_server
from tests.support.serve import post_batch, start_serve, stop_serve

pytestmark = pytest.mark.security

CHAT = "/v1/chat/completions"


def png(width: int = 8, height: int = 6) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, "PNG")
    return out.getvalue()


def image_line(url: str, custom_id: str = "img") -> dict[str, Any]:
    content = [{"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"custom_id": custom_id, "messages": [{"role": "user", "content": content}]}


def refusal(url: str) -> str | None:
    """Why validation refuses a line naming `url` (None: accepted)."""
    try:
        parse_line(image_line(url), 1, settings=get_settings())
    except LineProblem as exc:
        assert exc.field == "messages.0.content.1.image_url", exc.field
        return exc.message
    return None


def configure(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()


def validate_file(path: Path, lines: list[dict[str, Any]]) -> tuple[int, dict[str, str]]:
    """Validate a file of lines as batch create does: (rows that run, {custom_id: error})."""
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    runnable, errors = 0, {}
    for table, problems in read_row_chunks(source_of(path), settings=get_settings()):
        runnable += table.num_rows - len(problems)
        errors.update({problem.custom_id: problem.message for problem in problems})
    return runnable, errors


# -- local servers that record what reaches them ---------------------------------------------


class Recorder(socketserver.ThreadingTCPServer):
    """Any TCP service on 127.0.0.1: records each connection's first bytes and answers a bare
    HTTP 404 (an S3 client that reached it gets an answer at once, not a retry loop)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        super().__init__(("127.0.0.1", 0), _RecordOne)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _RecordOne(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(5)
        try:
            head = self.request.recv(65536)
        except OSError:
            head = b""
        self.server.requests.append(head)  # type: ignore[attr-defined]
        self.request.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")


@dataclass
class ImageServer:
    """An http image server: /cat.png, /delay/<n>.png (1 s, then a PNG), /slow/<n> (held 4 s,
    then 404), /drip.png (a byte every 0.5 s for 10 s), /status/<code>, /to?<url> (a 302 to
    the URL), /loop (a 302 to itself). Records every request path and the most in flight."""

    host: str
    port: int = 0  # 0: any free one
    httpd: http.server.ThreadingHTTPServer = field(init=False)
    paths: list[str] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                with served.lock:
                    served.paths.append(self.path)
                    served.in_flight += 1
                    served.most_in_flight = max(served.most_in_flight, served.in_flight)
                try:
                    served.answer(self)
                except OSError:
                    pass  # the client gave up
                finally:
                    with served.lock:
                        served.in_flight -= 1

        self.httpd = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.httpd.server_address[1]}"

    def answer(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        path = handler.path
        if path.startswith("/to?"):
            self._status(handler, 302, {"Location": path[len("/to?") :]})
        elif path == "/loop":
            self._status(handler, 302, {"Location": "/loop"})
        elif path.startswith("/status/"):
            self._status(handler, int(path.rsplit("/", 1)[1]))
        elif path.startswith("/slow/"):
            time.sleep(4)
            self._status(handler, 404)
        elif path == "/drip.png":
            handler.send_response(200)
            handler.send_header("Content-Length", "100000")
            handler.end_headers()
            for _ in range(20):
                handler.wfile.write(b"x")
                handler.wfile.flush()
                time.sleep(0.5)
        else:
            if path.startswith("/delay/"):
                time.sleep(1)
            elif path != "/cat.png":
                self._status(handler, 404)
                return
            body = png()
            handler.send_response(200)
            handler.send_header("Content-Type", "image/png")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)

    @staticmethod
    def _status(
        handler: http.server.BaseHTTPRequestHandler,
        code: int,
        headers: dict[str, str] | None = None,
    ) -> None:
        handler.send_response(code)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def assert_fetched_side_by_side(images: ImageServer, elapsed: float) -> None:
    """The 8 images of /delay/<i>.png (1 s each) were fetched at once, not one after another."""
    assert elapsed < 6.5, (
        f"{elapsed:.1f} s for 8 images of 1 s each (one after another: 8 s or more)"
    )
    assert images.most_in_flight >= 2
    assert sorted(images.paths) == sorted(f"/delay/{i}.png" for i in range(8))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    with contextlib.closing(Recorder()) as server:
        yield server


@pytest.fixture
def images() -> Iterator[ImageServer]:
    with contextlib.closing(ImageServer("127.0.0.1")) as server:
        yield server


@pytest.fixture
def other_images() -> Iterator[ImageServer]:
    """An image server on 127.0.0.2: a loopback address a test lets in on its own."""
    with contextlib.closing(ImageServer("127.0.0.2")) as server:
        yield server


# -- finding 2: s3:// URIs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with moto_server(tmp_path_factory.mktemp("moto")) as running:
        yield running


@dataclass
class Buckets:
    images: str  # BATCHLLM_IMAGE_S3_PREFIX is s3://<images>/ok/
    other: str  # another bucket the deployment's credentials reach


@pytest.fixture
def buckets(s3_server: S3Server, settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Buckets]:
    """Two buckets holding images inside and outside the allowed prefix s3://<images>/ok/."""
    images, other = s3_server.new_bucket(), s3_server.new_bucket()
    fs = s3_server.filesystem()
    for key in (
        f"{images}/ok/b.png",
        f"{images}/ok/a b.png",
        f"{images}/ok2/x.png",
        f"{images}/other/secret.png",
        f"{other}/secret.png",
    ):
        with fs.open_output_stream(key) as out:
            out.write(png())
    env = s3_server.env(images)
    env["BATCHLLM_IMAGE_S3_PREFIX"] = f"s3://{images}/ok/"
    configure(monkeypatch, **env)
    yield Buckets(images, other)
    get_settings.cache_clear()


def test_an_s3_uri_with_store_options_is_refused_and_no_request_reaches_the_named_host(
    buckets: Buckets, recorder: Recorder, tmp_path: Path
) -> None:
    """The probe of finding 2: options in the query (endpoint_override, scheme) made the server
    send a signed request, with its access key id, to a host the tenant chose."""
    steer = f"endpoint_override={recorder.address}&scheme=http"
    probes = {
        "query": f"s3://{buckets.images}/ok/b.png?{steer}",
        "query after a folder": f"s3://{buckets.images}/ok/?{steer}",
        "empty query": f"s3://{buckets.images}/ok/b.png?",
        "user part": f"s3://{buckets.images}@{recorder.address}/ok/b.png",
    }
    lines = [image_line(url, name) for name, url in probes.items()]
    # A '?' written as %3F is part of the key, never a query: a missing object, no request out.
    lines.append(image_line(f"s3://{buckets.images}/ok/b.png%3F{steer.replace('&', '%26')}", "%3F"))
    lines.append(image_line(f"s3://{buckets.images}/ok/b.png", "inside"))
    runnable, errors = validate_file(tmp_path / "steer.jsonl", lines)
    assert recorder.requests == []
    assert runnable == 1 and set(errors) == {*probes, "%3F"}
    for name in ("query", "query after a folder", "empty query"):
        assert "has a query or fragment" in errors[name], errors[name]
    assert "is not a bucket name" in errors["user part"]
    assert errors["%3F"].startswith("no such image object: s3://"), errors["%3F"]
    with pytest.raises(ImageProblem, match="has a query or fragment"):
        open_image(
            probes["query"], decode=False, settings=get_settings()
        )  # the worker's read, through the same parser
    assert recorder.requests == []


def test_dot_dot_segments_cannot_leave_the_prefix_or_the_bucket(buckets: Buckets) -> None:
    inside = f"s3://{buckets.images}/ok"
    # S3 clients resolve '..' themselves: unparsed, these read other/secret.png and the
    # other bucket's secret.png.
    assert "outside the allowed s3 prefix" in (refusal(f"{inside}/../other/secret.png") or "")
    assert "climbs above the bucket" in (
        refusal(f"{inside}/../../{buckets.other}/secret.png") or ""
    )
    with pytest.raises(ImageProblem, match="outside the allowed s3 prefix"):
        open_image(f"{inside}/../other/secret.png", decode=False, settings=get_settings())
    # Resolved, a path that stays inside reads its object.
    assert refusal(f"{inside}/./sub/../b.png") is None


def test_percent_encoded_dot_dot_is_decoded_before_the_prefix_check(buckets: Buckets) -> None:
    inside = f"s3://{buckets.images}/ok"
    for url in (
        f"{inside}/%2e%2e/other/secret.png",
        f"{inside}/%2E%2E%2Fother%2Fsecret.png",
        f"{inside}%2F..%2Fother/secret.png",
    ):
        assert "outside the allowed s3 prefix" in (refusal(url) or ""), url
    assert "climbs above the bucket" in (
        refusal(f"{inside}/%2e%2e/%2e%2e/{buckets.other}/secret.png") or ""
    )
    assert refusal(f"{inside}/a%20b.png") is None  # a decoded name reads its object


def test_a_sibling_folder_of_the_prefix_is_outside_it(buckets: Buckets) -> None:
    assert "outside the allowed s3 prefix" in (refusal(f"s3://{buckets.images}/ok2/x.png") or "")
    assert "outside the allowed s3 prefix" in (refusal(f"s3://{buckets.other}/ok/b.png") or "")
    assert refusal(f"s3://{buckets.images}/ok/b.png") is None


def test_an_s3_uri_with_a_fragment_is_refused(buckets: Buckets) -> None:
    for url in (
        f"s3://{buckets.images}/ok/b.png#x",
        f"s3://{buckets.images}/ok/b.png#/../../other/secret.png",
    ):
        assert "has a query or fragment" in (refusal(url) or ""), url


# -- finding 6: http(s) images ------------------------------------------------------------------

ONE_TEXT = "no answer, an error status, a refused address or over the time limits"


def one_text(message: str | None, url: str) -> str:
    """A fetch failure's message with its URL taken out: the same for every failure."""
    assert message is not None, f"{url} was accepted"
    return message.replace(shown(url), "URL")


@pytest.fixture
def http_on(settings, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    configure(monkeypatch, BATCHLLM_ALLOW_HTTP_IMAGES="true")
    return monkeypatch


def test_by_default_loopback_is_refused_and_no_request_reaches_it(
    http_on: pytest.MonkeyPatch, images: ImageServer
) -> None:
    port = images.httpd.server_address[1]
    for url in (
        f"{images.base}/cat.png",
        f"http://localhost:{port}/cat.png",
        f"http://2130706433:{port}/cat.png",  # 127.0.0.1 as one number
        f"http://0x7f.1:{port}/cat.png",
        f"http://0.0.0.0:{port}/cat.png",  # Linux connects it to the local host
        f"http://[::ffff:127.0.0.1]:{port}/cat.png",
        f"http://[::1]:{port}/cat.png",
    ):
        assert (
            one_text(refusal(url), url)
            == f"cannot fetch image URL: {ONE_TEXT} (the server's log says which)"
        )
    with pytest.raises(ImageProblem, match=ONE_TEXT):
        open_image(
            f"{images.base}/cat.png", decode=False, settings=get_settings()
        )  # the worker's read
    assert images.paths == []
    # The escape hatch lets a named network in (here, the test's own server).
    configure(http_on, BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.1/32")
    assert refusal(f"{images.base}/cat.png") is None
    assert images.paths == ["/cat.png"]


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every connection attempt of the process (each refused at once, none leaves the host);
    and names of the .test domain resolved as the test says."""
    attempts: list[tuple[str, int]] = []

    def create_connection(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        attempts.append((address[0], address[1]))
        raise ConnectionRefusedError(111, "refused by the test")

    real_getaddrinfo = socket.getaddrinfo
    names = {
        "private.test": ["10.1.2.3"],
        "mixed.test": ["93.184.215.14", "192.168.7.7"],
        "metadata.test": ["169.254.169.254"],
    }

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host in names:
            return [
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))
                for address in names[host]
            ]
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def test_private_link_local_and_metadata_addresses_are_refused_before_any_connection(
    http_on: pytest.MonkeyPatch, connections: list[tuple[str, int]]
) -> None:
    urls = [
        "http://10.0.0.1/cat.png",
        "http://172.16.5.4/cat.png",
        "http://192.168.0.1/cat.png",
        "http://100.64.0.1/cat.png",  # shared (carrier-grade NAT)
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://169.254.10.10/cat.png",
        "http://100.100.100.200/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://[fe80::1]/cat.png",
        "http://[fc00::1]/cat.png",
        "http://224.0.0.1/cat.png",
        "http://0.0.0.0/cat.png",
        "http://[::]/cat.png",
        "http://[64:ff9b::a00:1]/cat.png",  # NAT64 of 10.0.0.1
        "https://private.test/cat.png",
        "http://mixed.test/cat.png",  # one public address and one private one
        "http://metadata.test/",
    ]
    texts = {one_text(refusal(url), url) for url in urls}
    assert texts == {f"cannot fetch image URL: {ONE_TEXT} (the server's log says which)"}
    assert connections == []
    # Metadata stays refused inside a network the deployment lets in; the rest of it is let in.
    configure(http_on, BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="169.254.0.0/16")
    refusal("http://169.254.169.254/latest/meta-data/")
    assert connections == []
    refusal("http://169.254.10.10/cat.png")
    assert connections == [("169.254.10.10", 80)]


def test_a_redirect_to_loopback_is_refused_and_every_hop_is_checked(
    http_on: pytest.MonkeyPatch, images: ImageServer, other_images: ImageServer
) -> None:
    configure(http_on, BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.2/32")
    targets = [f"{images.base}/cat.png", f"http://localhost:{images.httpd.server_address[1]}/"]
    for target in targets:
        url = f"{other_images.base}/to?{target}"
        assert ONE_TEXT in one_text(refusal(url), url)
    assert images.paths == []  # 127.0.0.1 is not let in: no request reached it
    assert other_images.paths == [f"/to?{target}" for target in targets]
    # A redirect between allowed addresses is followed; a loop ends after 5 redirects.
    assert refusal(f"{other_images.base}/to?/cat.png") is None
    other_images.paths.clear()
    assert ONE_TEXT in (refusal(f"{other_images.base}/loop") or "")
    assert other_images.paths == ["/loop"] * 6


def test_a_name_is_connected_at_the_address_that_was_checked(
    http_on: pytest.MonkeyPatch, images: ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DNS rebind: the first answer is an allowed address (127.0.0.2), every later one
    loopback, where a server listens on the same port. The fetch resolves once and connects
    to the address it checked."""
    configure(http_on, BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.2/32")
    port = images.httpd.server_address[1]
    allowed = ImageServer("127.0.0.2", port)
    answers = iter(["127.0.0.2"])
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "rebind.test":
            address = next(answers, "127.0.0.1")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        assert refusal(f"http://rebind.test:{port}/cat.png") is None
    finally:
        allowed.close()
    assert allowed.paths == ["/cat.png"] and images.paths == []


def test_every_failed_fetch_has_one_text_closed_port_or_open(
    http_on: pytest.MonkeyPatch, images: ImageServer, recorder: Recorder
) -> None:
    configure(
        http_on,
        BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.0/8",
        BATCHLLM_IMAGE_FETCH_TIMEOUT="1.5",
    )
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    silent = socket.socket()  # listens, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    garbage = socket.socket()  # answers something that is not HTTP, then closes
    garbage.bind(("127.0.0.1", 0))
    garbage.listen(8)

    def babble() -> None:
        with contextlib.suppress(OSError):  # the test closes the socket
            connection, _ = garbage.accept()
            connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            connection.close()

    threading.Thread(target=babble, daemon=True).start()
    try:
        urls = [
            f"http://127.0.0.1:{closed_port}/cat.png",
            f"http://127.0.0.1:{silent.getsockname()[1]}/cat.png",
            f"http://127.0.0.1:{garbage.getsockname()[1]}/cat.png",
            f"http://{recorder.address}/cat.png",  # a 404 from a raw TCP service
            f"{images.base}/status/500",
            f"{images.base}/status/403",
        ]
        texts = {url: one_text(refusal(url), url) for url in urls}
        # And the same text where the address itself is refused.
        configure(http_on, BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="")
        texts["refused address"] = one_text(refusal(urls[0]), urls[0])
    finally:
        silent.close()
        garbage.close()
    assert set(texts.values()) == {
        f"cannot fetch image URL: {ONE_TEXT} (the server's log says which)"
    }, texts


def test_the_file_deadline_bounds_n_slow_images(
    http_on: pytest.MonkeyPatch, images: ImageServer, tmp_path: Path
) -> None:
    """12 images each held 4 s: one after another they took 48 s of a request thread; now
    4 at a time, and all of them within the file's 2 s."""
    configure(
        http_on,
        BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.1/32",
        BATCHLLM_IMAGE_FETCH_TIMEOUT="10",
        BATCHLLM_IMAGE_FETCH_DEADLINE="2",
        BATCHLLM_IMAGE_FETCH_WORKERS="4",
    )
    lines = [image_line(f"{images.base}/slow/{i}", f"slow-{i}") for i in range(12)]
    started = time.monotonic()
    runnable, errors = validate_file(tmp_path / "slow.jsonl", lines)
    elapsed = time.monotonic() - started
    assert elapsed < 8, f"{elapsed:.1f} s (one after another: 48 s)"
    assert runnable == 0 and len(errors) == 12
    assert all(ONE_TEXT in message for message in errors.values()), errors
    assert 2 <= images.most_in_flight <= 4  # concurrent, and no more than the pool


def test_a_file_s_images_are_fetched_concurrently(
    http_on: pytest.MonkeyPatch, images: ImageServer, tmp_path: Path
) -> None:
    configure(
        http_on,
        BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.1/32",
        BATCHLLM_IMAGE_FETCH_WORKERS="4",
    )
    lines = [image_line(f"{images.base}/delay/{i}.png", f"delay-{i}") for i in range(8)]
    started = time.monotonic()
    runnable, errors = validate_file(tmp_path / "delay.jsonl", lines)
    elapsed = time.monotonic() - started
    assert (runnable, errors) == (8, {})
    assert_fetched_side_by_side(images, elapsed)


def test_a_body_sent_a_byte_at_a_time_ends_at_the_fetch_timeout(
    http_on: pytest.MonkeyPatch, images: ImageServer
) -> None:
    configure(
        http_on,
        BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.1/32",
        BATCHLLM_IMAGE_FETCH_TIMEOUT="2",
    )
    started = time.monotonic()
    message = refusal(f"{images.base}/drip.png")
    elapsed = time.monotonic() - started
    assert ONE_TEXT in (message or ""), message
    assert elapsed < 6, f"{elapsed:.1f} s (the drip lasts 10 s)"


# -- through `batchllm serve` -------------------------------------------------------------------


def test_batch_create_on_serve_refuses_the_probes_and_no_request_leaves(
    s3_server: S3Server, recorder: Recorder, images: ImageServer, tmp_path: Path
) -> None:
    """The server's own validation (a real `batchllm serve`): the rows naming store options, a
    climb out of the bucket and a loopback URL are failed requests, the image inside the prefix
    is not, and neither the recorder nor the loopback image server hears a thing."""
    bucket, other = s3_server.new_bucket(), s3_server.new_bucket()
    fs = s3_server.filesystem()
    for key in (f"{bucket}/ok/b.png", f"{other}/secret.png"):
        with fs.open_output_stream(key) as out:
            out.write(png())
    env = s3_server.env(bucket)
    del env["BATCHLLM_STORAGE"]  # the job storage stays local; images come from the prefix
    served = start_serve(
        tmp_path,
        **env,
        BATCHLLM_IMAGE_S3_PREFIX=f"s3://{bucket}/ok/",
        BATCHLLM_ALLOW_HTTP_IMAGES="true",
    )
    urls = {
        "inside": f"s3://{bucket}/ok/b.png",
        "steer": f"s3://{bucket}/ok/b.png?endpoint_override={recorder.address}&scheme=http",
        "escape": f"s3://{bucket}/ok/../../{other}/secret.png",
        "loopback": f"{images.base}/cat.png",
    }
    lines = b""
    for custom_id, url in urls.items():
        body = image_line(url) | {"model": "tiny"}
        del body["custom_id"]
        line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}
        lines += json.dumps(line).encode() + b"\n"
    try:
        with httpx.Client(base_url=served.base_url, headers=served.new_key(), timeout=60) as client:
            created = post_batch(client, lines, filename="images.jsonl")
            assert created.status_code == 200, created.text
            batch = client.get(f"/v1/batches/{created.json()['id']}").json()
    finally:
        stop_serve(served)
    assert batch["request_counts"]["total"] == 4, batch
    shards = Path(served.settings.resolved_storage, job_id_of(batch["id"]), "input").glob(
        "shard-*.parquet"
    )
    rows = pa.concat_tables(pq.read_table(shard) for shard in shards).to_pylist()
    stored = {row["custom_id"]: (row["kind"], row["error"] or "") for row in rows}
    assert stored.keys() == urls.keys()
    assert stored["inside"] == ("chat", "")
    assert stored["steer"][0] == "invalid" and "has a query or fragment" in stored["steer"][1]
    assert stored["escape"][0] == "invalid" and "climbs above the bucket" in stored["escape"][1]
    assert stored["loopback"][0] == "invalid" and ONE_TEXT in stored["loopback"][1]
    assert recorder.requests == []
    assert images.paths == []


def test_a_parquet_table_s_images_are_fetched_concurrently_and_checked_the_same_way(
    http_on: pytest.MonkeyPatch, images: ImageServer, tmp_path: Path
) -> None:
    """Table input (a messages column of JSON text) goes through the same checks: its
    images fetched 4 at a time, a loopback URL refused without a request."""
    from batchllm.input.shards import validated_chunks
    from batchllm.spec import TableColumns

    configure(
        http_on,
        BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.1/32",
        BATCHLLM_IMAGE_FETCH_WORKERS="4",
    )
    urls = [f"{images.base}/delay/{i}.png" for i in range(8)]
    urls.append(f"http://[::1]:{images.httpd.server_address[1]}/cat.png")  # not let in
    path = tmp_path / "images.parquet"
    messages = [json.dumps(image_line(url)["messages"]) for url in urls]
    pq.write_table(pa.table({"id": [f"row-{i}" for i in range(9)], "messages": messages}), path)
    table = TableColumns(messages_column="messages", id_column="id")
    started = time.monotonic()
    chunks = list(validated_chunks(source_of(path), table=table, settings=get_settings()))
    elapsed = time.monotonic() - started
    problems = {problem.custom_id: problem.message for _, found in chunks for problem in found}
    assert sum(chunk.num_rows for chunk, _ in chunks) == 9
    assert list(problems) == ["row-8"] and ONE_TEXT in problems["row-8"]
    assert_fetched_side_by_side(images, elapsed)


def test_the_deadline_counts_the_wait_for_images_only_and_once_spent_fetches_nothing(
    http_on: pytest.MonkeyPatch, images: ImageServer
) -> None:
    """A long file's other work does not use up its images' time (an image late in a file
    that takes minutes to validate is still fetched); waiting for images does, and once it is
    spent the file's remaining http images are refused without a request."""
    from batchllm.input.images import ImageChecks, check_image

    configure(
        http_on,
        BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS="127.0.0.1/32",
        BATCHLLM_IMAGE_FETCH_DEADLINE="1.5",
    )
    checks = ImageChecks(settings=get_settings())
    try:
        time.sleep(2)  # the validation of other lines
        with checks.prefetching([f"{images.base}/cat.png"]):
            check_image(f"{images.base}/cat.png", settings=get_settings())
        slow, late = f"{images.base}/slow/1", f"{images.base}/delay/1.png"
        with checks.prefetching([slow]):
            started = time.monotonic()
            with pytest.raises(ImageProblem, match=ONE_TEXT):
                check_image(slow, settings=get_settings())
            assert time.monotonic() - started < 3
        with checks.prefetching([late]), pytest.raises(ImageProblem, match=ONE_TEXT):
            check_image(late, settings=get_settings())
    finally:
        checks.close()
    assert images.paths == ["/cat.png", "/slow/1"]
