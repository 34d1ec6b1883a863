"""Images in chat lines: OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` content
parts, read from a `data:` URL, a local path under BATCHLLM_IMAGE_ROOT, an `s3://` object under
the allowed prefix (s3.py) or, when BATCHLLM_ALLOW_HTTP_IMAGES is on, an http(s) URL of a public
address (web.py).

A line keeps its images as these references (the stored shard holds the URL, never pixels).
Validation checks every image once (checks.py: an input file's http images fetched
concurrently, within one deadline), so a bad one is an error row naming its part before any
engine time; the engine side opens them again, through the same readers, when their row is
prepared.
"""

from batchllm.input.images.checks import ImageChecks, check_image, image_urls
from batchllm.input.images.problem import ImageProblem, shown
from batchllm.input.images.reading import decoded, image_parts, open_image, read_image_bytes
from batchllm.input.images.s3 import s3_image_prefix

__all__ = [
    "ImageChecks",
    "ImageProblem",
    "check_image",
    "decoded",
    "image_parts",
    "image_urls",
    "open_image",
    "read_image_bytes",
    "s3_image_prefix",
    "shown",
]
