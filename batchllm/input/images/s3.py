"""s3:// images: the URI parsed into a bucket and a normalised key, never prefix-matched as text.

A tenant's URI is refused with a query or a fragment (pyarrow reads options such as
`endpoint_override` from an s3:// URI's query, which would let a line choose the server the
deployment's credentials are sent to); its key is percent-decoded and its `.`/`..` segments
resolved (S3 clients resolve `..` themselves, so `s3://imgs/ok/../../other/x` would otherwise
reach `other/x`) before it is compared with the allowed prefix, segment by segment
(`s3://imgs/ok/` admits `ok/x.png`, not `ok2/x.png`). The object is then read by bucket and key
on a filesystem built from the deployment's settings only (storage.s3_bucket_filesystem): no
text of the line is ever parsed as a URI again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from batchllm.input.images.problem import ImageProblem, shown
from batchllm.settings import Settings
from batchllm.storage import s3_bucket_filesystem

# Bucket names as S3 has allowed them (lower case today; upper case and '_' in old us-east-1
# buckets); nothing that could be a user, a password or a port.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


@dataclass(frozen=True)
class S3Object:
    """An s3:// location: a bucket and the segments of a normalised key (of a prefix: the
    folders it allows, none for a whole bucket)."""

    bucket: str
    key: tuple[str, ...]

    @property
    def path(self) -> str:
        """pyarrow's path of the object: bucket/key."""
        return "/".join((self.bucket, *self.key))

    @property
    def uri(self) -> str:
        """The normalised URI, percent-encoded: a '?' or '#' of the key stays part of it."""
        return f"s3://{self.bucket}/" + quote("/".join(self.key), safe="/")

    def is_under(self, prefix: S3Object) -> bool:
        """Whether this object lies in the prefix's bucket, under its folders."""
        depth = len(prefix.key)
        return (
            self.bucket == prefix.bucket
            and len(self.key) > depth
            and self.key[:depth] == prefix.key
        )


def parse_s3_uri(uri: str, *, folder: bool = False) -> S3Object:
    """The bucket and normalised key an s3:// URI names; ImageProblem saying why for a URI
    that is not a plain s3://bucket/key (`folder`: a prefix, which may end in '/' or name a
    whole bucket)."""
    if uri[:5].lower() != "s3://":
        raise ImageProblem(f"{shown(uri)!r} is not an s3:// URI")
    rest = uri[5:]
    if "?" in rest or "#" in rest:
        raise ImageProblem(
            f"s3 image URL {shown(uri)!r} has a query or fragment ('?' or '#'): s3:// images "
            "are s3://bucket/key only (the store's options come from the deployment's settings)"
        )
    bucket, _, raw_key = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ImageProblem(
            f"s3 image URL {shown(uri)!r}: {shown(bucket)!r} is not a bucket name "
            "(letters, digits, '.', '-' and '_')"
        )
    return S3Object(bucket, _normalised_key(raw_key, uri, folder=folder))


def _normalised_key(raw_key: str, uri: str, *, folder: bool) -> tuple[str, ...]:
    try:
        text = unquote(raw_key, errors="strict")
    except UnicodeDecodeError:
        raise ImageProblem(
            f"s3 image URL {shown(uri)!r}: percent-encoding that is not UTF-8"
        ) from None
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ImageProblem(f"s3 image URL {shown(uri)!r}: a control character in the key")
    parts = text.split("/")
    if folder and parts[-1] == "":
        parts.pop()
    segments: list[str] = []
    for part in parts:
        if part == "":
            raise ImageProblem(
                f"s3 image URL {shown(uri)!r}: an empty key segment ('//' or a trailing '/')"
            )
        if part == "..":
            if not segments:
                raise ImageProblem(f"s3 image URL {shown(uri)!r}: its key climbs above the bucket")
            segments.pop()
        elif part != ".":
            segments.append(part)
    if not segments and not folder:
        raise ImageProblem(f"s3 image URL {shown(uri)!r} names no object")
    return tuple(segments)


def s3_image_prefix(settings: Settings) -> str | None:
    """Where s3:// images may be read: BATCHLLM_IMAGE_S3_PREFIX, else the storage's bucket."""
    if settings.image_s3_prefix:
        return settings.image_s3_prefix
    storage = settings.storage or ""
    if storage.startswith("s3://"):
        return f"s3://{urlsplit(storage).netloc.rpartition('@')[2]}/"
    return None


def _allowed_prefix(settings: Settings) -> S3Object:
    text = s3_image_prefix(settings)
    if text is None:
        raise ImageProblem(
            "s3:// images are read from the job's S3 storage (BATCHLLM_STORAGE=s3://...) or "
            "under BATCHLLM_IMAGE_S3_PREFIX; neither is set here"
        )
    try:
        return parse_s3_uri(text, folder=True)
    except ImageProblem as exc:
        raise ImageProblem(f"BATCHLLM_IMAGE_S3_PREFIX={text!r} is not a prefix: {exc}") from None


def s3_bytes(url: str, settings: Settings) -> bytes:
    """The bytes of an s3:// image under the allowed prefix (at most one more than the size
    limit), read with the deployment's S3 settings."""
    prefix = _allowed_prefix(settings)
    image = parse_s3_uri(url)
    if not image.is_under(prefix):
        named = shown(image.uri) + ("" if image.uri == url else f" (given as {shown(url)!r})")
        raise ImageProblem(f"image {named} is outside the allowed s3 prefix {prefix.uri}")
    try:
        fs = s3_bucket_filesystem(image.bucket, s3_endpoint=settings.resolved_s3_endpoint)
        with fs.open_input_stream(image.path) as source:
            return bytes(source.read(settings.max_image_bytes + 1))
    except FileNotFoundError:
        raise ImageProblem(f"no such image object: {shown(image.uri)}") from None
    except Exception as exc:  # OSError, a missing bucket, a refused credential
        reason = str(exc).split("\n")[0] or type(exc).__name__
        raise ImageProblem(f"cannot read image {shown(image.uri)}: {reason}") from None
