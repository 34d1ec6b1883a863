"""Images in chat lines up to the engine: validation opens every image once and names a bad
one's part; the stored row keeps the reference (never pixels); preparation renders the image
placeholders, decodes the images and counts each image's tokens with the model's processor
(the tiny demo VLM's, built without weights); a text-only model's image rows are error rows."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest

from batchllm.engine.images import NO_IMAGES, ImageProcessor, ImagePrompt
from batchllm.engine.prompts import prepare_prompts, token_count
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.parsing.line import parse_line
from batchllm.input.parsing.problems import LineProblem
from batchllm.settings import get_settings
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests


def png(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_message(*urls: str, text: str = "What is this?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture
def images_dir(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "images"
    root.mkdir()
    (root / "cat.png").write_bytes(png(48, 40))
    (root / "broken.png").write_bytes(png(48, 40)[:60])  # a truncated file
    monkeypatch.setenv("BATCHLLM_IMAGE_ROOT", str(root))
    get_settings.cache_clear()
    yield root
    get_settings.cache_clear()


def problem(obj: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(LineProblem) as caught:
        parse_line(obj, 1, settings=get_settings())
    return caught.value.field, caught.value.message


def test_an_image_line_keeps_its_references_in_both_openai_forms(images_dir: Path) -> None:
    url = data_url(png(20, 30))
    chat = parse_line({"messages": image_message(url, "cat.png")}, 1, settings=get_settings())
    assert chat.kind == "chat" and chat.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": {"url": "cat.png"}},
            ],
        }
    ]
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": image_message(str(images_dir / "cat.png")), "max_tokens": 3},
    }
    batch = parse_line(line, 2, settings=get_settings())
    assert batch.messages is not None
    assert batch.messages[0]["content"][1]["image_url"] == {"url": str(images_dir / "cat.png")}
    # A text-only message is stored as before: its text joined.
    plain = parse_line(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        3,
        settings=get_settings(),
    )
    assert plain.messages == [{"role": "user", "content": "hi"}]


def test_a_bad_image_is_an_error_naming_its_part(images_dir: Path, monkeypatch) -> None:
    field = "messages.0.content.1.image_url"
    cases = {
        data_url(b"not an image"): "not a decodable image (unknown image format)",
        "data:image/png;base64,%%%": "data URL is not valid base64",
        "data:text/plain;base64,aGk=": "not an image (data:image/...)",
        "broken.png": "not a decodable image",
        "missing.png": "no such image file: missing.png",
        "/etc/hostname": "is outside BATCHLLM_IMAGE_ROOT",
        "../images/../../x.png": "is outside BATCHLLM_IMAGE_ROOT",
        "https://example.com/cat.png": "http(s) image URLs are off",
        "ftp://example.com/cat.png": "unsupported image URL scheme 'ftp'",
    }
    for url, expected in cases.items():
        assert problem({"messages": image_message(url)})[0] == field, url
        assert expected in problem({"messages": image_message(url)})[1], url
    body = {"method": "POST", "url": "/v1/chat/completions", "custom_id": "x"}
    body["body"] = {"messages": image_message(data_url(b"junk"))}
    assert problem(body)[0] == "body." + field
    assistant = [{"role": "assistant", "content": image_message("cat.png")[0]["content"]}]
    assert problem({"messages": assistant}) == (
        field,
        "images are for user messages, not assistant",
    )
    monkeypatch.setenv("BATCHLLM_MAX_IMAGE_PIXELS", "100")
    get_settings.cache_clear()
    assert (
        "48x40 pixels, over the limit of 100" in problem({"messages": image_message("cat.png")})[1]
    )
    monkeypatch.setenv("BATCHLLM_MAX_IMAGE_BYTES", "10")
    get_settings.cache_clear()
    assert (
        "over the limit of 10 (BATCHLLM_MAX_IMAGE_BYTES)"
        in problem({"messages": image_message("cat.png")})[1]
    )


def test_an_image_part_of_the_wrong_shape_is_an_error_naming_it(settings) -> None:
    def part(**fields: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": [{"type": "image_url", **fields}]}]}

    field = "messages.0.content.0.image_url"
    assert problem(part()) == (field, "expected {url: ...}")
    assert problem(part(image_url="data:image/png;base64,")) == (field, "expected {url: ...}")
    assert problem(part(image_url={"url": " "})) == (field + ".url", "url is empty")
    assert problem(part(image_url={"url": "x", "size": 3})) == (
        field,
        "unknown image_url field(s): size",
    )
    assert problem(part(image_url={"url": "x", "detail": "max"})) == (
        field + ".detail",
        "detail is auto, low or high",
    )
    audio = {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}
    assert problem(audio)[0] == "messages.0.content"


def test_local_images_are_refused_without_an_image_root(settings) -> None:
    field, message = problem({"messages": image_message("/tmp/cat.png")})
    assert field == "messages.0.content.1.image_url" and "set BATCHLLM_IMAGE_ROOT" in message


def test_a_file_of_image_lines_validates_to_rows_and_error_rows(images_dir: Path, tmp_path) -> None:
    lines = [
        {"custom_id": "ok", "messages": image_message("cat.png")},
        {"custom_id": "bad", "messages": image_message(data_url(b"junk"))},
        {"custom_id": "text", "messages": [{"role": "user", "content": "hello"}]},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    items = list(read_requests(source_of(path), settings=get_settings()))
    assert [type(item) for item in items] == [Request, LineError, Request]
    assert isinstance(items[1], LineError)
    assert items[1].field == "messages.0.content.1.image_url"


@pytest.fixture(scope="module")
def vlm_processor() -> Any:
    pytest.importorskip("transformers")
    from batchllm.engine.models.demo_vlm import build_demo_vlm_processor

    return build_demo_vlm_processor()


def chat_row(line: int, messages: list[dict[str, Any]]) -> InputRow:
    return InputRow(line=line, custom_id=f"r{line}", kind="chat", messages=json.dumps(messages))


def prepared_for_vlm(vlm_processor, rows: list[InputRow], max_model_len: int = 512) -> list:
    """The rows prepared as the engine prepares them for the demo VLM: a prompt or a refusal
    each."""
    images = ImageProcessor(vlm_processor, settings=get_settings())
    return prepare_prompts(vlm_processor.tokenizer, rows, max_model_len, None, images)


def test_preparing_counts_each_image_in_the_prompt_tokens(images_dir: Path, vlm_processor) -> None:
    from batchllm.engine.models.demo_vlm import TOKENS_PER_IMAGE

    tokenizer = vlm_processor.tokenizer
    rows = [
        chat_row(1, image_message("cat.png")),
        chat_row(2, image_message(data_url(png(7, 300)), "cat.png", text="Compare")),
        chat_row(3, [{"role": "user", "content": "What is this?"}]),
    ]
    one, two, text = prepared_for_vlm(vlm_processor, rows)
    assert isinstance(one, ImagePrompt) and isinstance(two, ImagePrompt)
    assert [image.size for image in two.images] == [(7, 300), (48, 40)]
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert one.ids.count(image_id) == 1 and two.ids.count(image_id) == 2
    # The same prompt without its image: the image's placeholder becomes its tokens.
    assert isinstance(text, list)
    assert token_count(one) == len(text) - 1 + 1 + TOKENS_PER_IMAGE
    assert token_count(two) == len(two.ids) - 2 + 2 * TOKENS_PER_IMAGE
    # The processor itself agrees on the expanded length.
    rendered = tokenizer.decode(one.ids)
    expanded = vlm_processor(text=[rendered], images=[one.images], add_special_tokens=False)
    assert len(expanded["input_ids"][0]) == one.tokens
    # Over the context: an error naming the image tokens.
    (refused,) = prepared_for_vlm(vlm_processor, rows[:1], one.tokens)
    assert refused == (
        f"prompt is {one.tokens} tokens with its images; the engine's max_model_len is "
        f"{one.tokens} (prompt plus at least one output token must fit)"
    )


def test_a_text_only_model_makes_image_rows_error_rows(images_dir: Path, vlm_processor) -> None:
    rows = [chat_row(1, image_message("cat.png")), chat_row(2, [{"role": "user", "content": "hi"}])]
    for images in (
        None,
        ImageProcessor(None, settings=get_settings()),
        ImageProcessor(vlm_processor.tokenizer, settings=get_settings()),
    ):
        refused, ok = prepare_prompts(vlm_processor.tokenizer, rows, 512, None, images)
        assert refused == NO_IMAGES and isinstance(ok, list) and ok


def test_an_image_gone_since_validation_is_an_error_row(images_dir: Path, vlm_processor) -> None:
    row = chat_row(1, image_message("cat.png"))
    (images_dir / "cat.png").unlink()
    (refused,) = prepared_for_vlm(vlm_processor, [row])
    assert refused == "field 'messages.0.content.1.image_url': no such image file: cat.png"


def test_prepared_images_are_decoded_only_when_the_engine_takes_them(
    images_dir: Path, vlm_processor
) -> None:
    from batchllm.engine.images import decoded_images
    from batchllm.input.images import ImageProblem

    row = chat_row(1, image_message("cat.png"))
    (good,) = prepared_for_vlm(vlm_processor, [row])
    assert isinstance(good, ImagePrompt)
    assert [image.mode for image in decoded_images(good)] == ["RGB"]
    # Truncated since validation: the header still reads, the pixels do not.
    (images_dir / "cat.png").write_bytes((images_dir / "broken.png").read_bytes())
    (cut,) = prepared_for_vlm(vlm_processor, [row])
    assert isinstance(cut, ImagePrompt) and cut.tokens == good.tokens
    with pytest.raises(ImageProblem, match="not a decodable image"):
        decoded_images(cut)


def test_http_images_are_fetched_only_when_the_setting_allows(
    images_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(images_dir))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert (
            "http(s) image URLs are off"
            in problem({"messages": image_message(f"{base}/cat.png")})[1]
        )
        monkeypatch.setenv("BATCHLLM_ALLOW_HTTP_IMAGES", "true")
        # A local server: loopback is refused unless let in (tests/security/test_image_uris.py)
        monkeypatch.setenv("BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS", "127.0.0.1/32")
        get_settings.cache_clear()
        request = parse_line(
            {"messages": image_message(f"{base}/cat.png")}, 1, settings=get_settings()
        )
        assert request.messages is not None
        assert request.messages[0]["content"][1]["image_url"]["url"] == f"{base}/cat.png"
        field, message = problem({"messages": image_message(f"{base}/dog.png")})
        assert field == "messages.0.content.1.image_url"
        assert message.startswith(f"cannot fetch image {base}/dog.png: no answer, an error status")
    finally:
        server.shutdown()
        server.server_close()


def test_s3_images_are_refused_without_an_s3_storage_or_prefix(monkeypatch, tmp_path) -> None:
    from batchllm.input.images import ImageProblem, read_image_bytes
    from batchllm.settings import Settings

    local = Settings(home=tmp_path)
    with pytest.raises(ImageProblem, match="BATCHLLM_IMAGE_S3_PREFIX"):
        read_image_bytes("s3://bucket/cat.png", local)
    narrowed = Settings(home=tmp_path, image_s3_prefix="s3://bucket/images/")
    with pytest.raises(ImageProblem, match="outside the allowed s3 prefix"):
        read_image_bytes("s3://bucket/jobs/part-0.parquet", narrowed)
