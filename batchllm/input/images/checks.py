"""Checking an input file's images at validation: each opened and decoded once, its http(s)
images fetched ahead, a few at a time, and the time spent waiting for them bounded per file.

Validation reads a file a chunk of lines (or rows) at a time and checks its lines one by one.
An `ImageChecks` lives as long as one file's validation: before a chunk is checked, the http(s)
URLs its lines name are handed to a small pool (BATCHLLM_IMAGE_FETCH_WORKERS threads), which
fetches and decodes them while the lines are checked; a line's check then waits for its
image's verdict (kept as text, never as pixels, so memory stays that of the few images in
flight). The validation waits BATCHLLM_IMAGE_FETCH_DEADLINE seconds for a file's http images
in all (its other work, however long, does not count): a file of slow images costs that long,
not BATCHLLM_IMAGE_FETCH_TIMEOUT each; once it is spent, the file's remaining http images are
error rows without a fetch.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import ContextVar
from typing import Any

from batchllm.input.images.problem import ImageProblem
from batchllm.input.images.reading import open_image
from batchllm.input.images.web import fetch_failed
from batchllm.settings import Settings

_current: ContextVar[ImageChecks | None] = ContextVar("image_checks", default=None)


def check_image(url: str, settings: Settings) -> None:
    """Check that an image reference opens and decodes under `settings`; ImageProblem saying
    why not. Inside `ImageChecks.prefetching` the chunk's fetches (and the file's time for
    them) are used, under the ImageChecks' settings."""
    checks = _current.get()
    if checks is None:
        open_image(url, settings)
    else:
        checks.check(url)


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


class ImageChecks:
    """One input file's image checks (see the module's docstring); `close` when done."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.left = self.settings.image_fetch_deadline  # seconds still to wait for images
        self._pool: ThreadPoolExecutor | None = None  # started by the file's first http image
        self._verdicts: dict[str, Future[str | None]] = {}

    @contextlib.contextmanager
    def prefetching(self, urls: Iterable[str]) -> Iterator[None]:
        """Fetch the http(s) images among `urls` ahead while the body checks lines:
        check_image in it uses those fetches."""
        if self.settings.allow_http_images and self.left > 0:
            for url in urls:
                if url not in self._verdicts and _is_http(url):
                    self._verdicts[url] = self._started().submit(self._verdict, url)
        token = _current.set(self)
        try:
            yield
        finally:
            _current.reset(token)
            for verdict in self._verdicts.values():
                verdict.cancel()
            self._verdicts.clear()

    def check(self, url: str) -> None:
        if not _is_http(url):
            open_image(url, self.settings)
            return
        started = time.monotonic()
        try:
            verdict = self._verdicts.get(url)
            if verdict is None:  # one the scan of the lines missed: fetched here
                problem = self._verdict(url, deadline=started + max(self.left, 0.0))
            else:
                problem = verdict.result(timeout=max(self.left, 0.0))
        except (FutureTimeout, CancelledError):  # the file's time for images ran out
            problem = fetch_failed(url)
        finally:
            self.left -= time.monotonic() - started
            if self.left <= 0:
                for pending in self._verdicts.values():
                    pending.cancel()
        if problem is not None:
            raise ImageProblem(problem)

    def close(self) -> None:
        if self._pool is not None:
            # Fetches still running end by their own timeout; nobody waits for them.
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _verdict(self, url: str, deadline: float | None = None) -> str | None:
        """An image's problem as text (None: it opens and decodes). Text, not the exception:
        one kept in a future would keep its traceback's frames, and with them the image's
        bytes, until the chunk ends."""
        if self.left <= 0:  # the file's time for images is spent
            return fetch_failed(url)
        try:
            open_image(url, self.settings, deadline=deadline)  # the pixels are dropped
        except ImageProblem as exc:
            return str(exc)
        return None

    def _started(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.settings.image_fetch_workers, thread_name_prefix="image-fetch"
            )
        return self._pool


def image_urls(values: Iterable[Any]) -> Iterator[str]:
    """The image URLs named in lines or rows, in their order: every `{"image_url": {"url":
    ...}}` or `{"image_url": "..."}` at any depth of a decoded value, or of JSON text (bytes or
    str) that mentions image_url."""
    for value in values:
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, str | bytes):
                if _mentions_images(item):
                    with contextlib.suppress(ValueError, RecursionError):
                        stack.append(json.loads(item))
                continue
            if isinstance(item, dict):
                reference = item.get("image_url")
                if isinstance(reference, dict):
                    reference = reference.get("url")
                if isinstance(reference, str):
                    yield reference
                item = list(item.values())
            if isinstance(item, list):
                stack.extend(reversed([c for c in item if isinstance(c, dict | list)]))


def _mentions_images(text: str | bytes) -> bool:
    return "image_url" in text if isinstance(text, str) else b"image_url" in text
