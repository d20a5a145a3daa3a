"""OpenAI's images API as the server reads it, without Ray: a multipart form's parts as they were sent (the form the
official ``openai`` client's HTTP library writes), OpenAI's fields turned into the service's request, a refusal in
OpenAI's error shape naming the field, and an inpainting mask read as OpenAI's API reads it (repainted where
transparent). The answers through the official client, on a running server: tests/serve/test_serve.py."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("pydantic", reason="needs the serve extra (ray[serve])")

from optimum_iobinding.serve.schema import (  # noqa: E402
    OpenAIError,
    decode_mask,
    openai_edit_request,
    openai_generation_request,
    openai_request,
    parse_form,
)

MODEL = "tiny-sd"


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def form(fields: dict, files: list):
    """``(body, content type)`` of a multipart form as the ``openai`` client's HTTP library (httpx2) writes it."""
    httpx = pytest.importorskip("httpx2", reason="the openai client's HTTP library (the test extra)")
    request = httpx.Request("POST", "http://127.0.0.1/v1/images/edits", data=fields, files=files)
    return request.read(), request.headers["content-type"]


def test_a_multipart_forms_parts_come_as_they_were_sent():
    image = bytes(range(256)) * 4 + b"\r\n--\r\n\r\n" + b"\x00" * 10  # line ends and dashes inside a file
    body, content_type = form(
        {"prompt": "a cät", "n": "2"}, [("image", ("start.png", image, "image/png")), ("mask", ("m.png", b"", "x"))]
    )
    parts = parse_form(body, content_type)
    assert parts == {"prompt": ["a cät".encode()], "n": [b"2"], "image": [image], "mask": [b""]}


@pytest.mark.parametrize(
    "body, content_type, message",
    [
        (b"{}", "application/json", "body: expected multipart/form-data with a boundary, got 'application/json'"),
        (b"--x\r\n\r\nno name\r\n--x--", "multipart/form-data; boundary=x", "content-disposition naming their"),
        (b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n1', "multipart/form-data; boundary=x", "closing"),
    ],
    ids=["json", "part-without-a-name", "cut-short"],
)
def test_a_body_that_is_no_complete_multipart_form_is_refused_naming_the_body(body, content_type, message):
    with pytest.raises(OpenAIError, match=message) as refused:
        parse_form(body, content_type)
    assert refused.value.status == 400


def test_openais_fields_become_the_services_request_with_the_extensions():
    request = openai_request(
        {"prompt": "a cat", "model": MODEL, "size": "auto", "user": "u1", "seed": "5", "steps": "3", "guidance": "2.5"},
        MODEL,
    )
    assert request == dict(prompt="a cat", negative_prompt=None, seed=5, steps=3, guidance=2.5, size=None, n=1)
    request = openai_generation_request(b'{"prompt": "a cat", "n": 2, "size": "64x48"}', MODEL)
    assert (request["n"], request["size"]) == (2, "64x48")


def test_an_edit_takes_one_image_file_an_optional_mask_and_text_fields_where_empty_is_unset():
    body, content_type = form(
        {"prompt": "a cat", "strength": "0.5", "size": ""}, [("image[]", ("start.png", b"PNG", "image/png"))]
    )
    request = openai_edit_request(body, content_type, MODEL)
    assert (request["image"], request["mask"], request["strength"], request["size"]) == (b"PNG", None, 0.5, None)
    for files, message in (
        ([("mask", ("m.png", b"1", "image/png"))], "image: expected an image file, got none"),
        ([("image", ("a.png", b"1", "image/png")), ("image", ("b.png", b"2", "image/png"))], "image: expected one"),
    ):
        body, content_type = form({"prompt": "a cat"}, files)
        with pytest.raises(OpenAIError, match=message) as refused:
            openai_edit_request(body, content_type, MODEL)
        assert refused.value.param == "image"


REFUSALS = [
    ({"n": 1}, 400, "prompt", "missing_required_parameter", "prompt: expected a value, got none"),
    ({"prompt": "x", "stepz": 3}, 400, "stepz", "unknown_parameter", "stepz: unknown field; did you mean steps?"),
    ({"prompt": "x", "style": "vivid"}, 400, "style", "unknown_parameter", "OpenAI's images API has it; this server"),
    ({"prompt": "x", "n": "two"}, 400, "n", "invalid_type", "n: expected a valid integer, unable to parse string"),
    ({"prompt": "x", "n": 0}, 400, "n", "invalid_value", "n: expected greater than or equal to 1, got 0"),
    ({"prompt": "x", "n": 1.5}, 400, "n", "invalid_type", "n: expected a valid integer, got 1.5"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format", "unsupported_value", "has no URL to give"),
    ({"prompt": "x", "output_format": "jpeg"}, 400, "output_format", "unsupported_value", "expected 'png'"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model", "model_not_found", f"expected {MODEL!r} (the model served"),
]


@pytest.mark.parametrize(
    "fields, status, param, code, message", REFUSALS, ids=[refusal[2] + "-" + refusal[3] for refusal in REFUSALS]
)
def test_a_refusal_names_the_field_with_openais_status_and_code(fields, status, param, code, message):
    with pytest.raises(OpenAIError) as refused:
        openai_request(fields, MODEL)
    assert (refused.value.status, refused.value.param, refused.value.code) == (status, param, code)
    assert message in refused.value.message and refused.value.message.startswith(f"{param}: ")


def test_the_error_body_has_openais_shape():
    assert OpenAIError(400, "n: expected at most 4", "n").body() == {
        "error": {
            "message": "n: expected at most 4",
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_value",
        }
    }
    assert OpenAIError(503, "pipeline: expected images").body()["error"] == {
        "message": "pipeline: expected images",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    with pytest.raises(OpenAIError, match="body: expected a JSON object, got list"):
        openai_generation_request(b"[]", MODEL)


def test_a_mask_is_repainted_where_it_is_transparent_or_without_alpha_where_it_is_light():
    square = np.zeros((4, 6), bool)
    square[1:3, 2:5] = True
    rgba = np.full((4, 6, 4), 255, np.uint8)
    rgba[square, 3] = 0  # OpenAI's mask: transparent where the image is edited, whatever its colour
    assert np.array_equal(decode_mask(png(rgba), (6, 4)), square.astype(np.float32))
    grey = np.where(square, 255, 0).astype(np.uint8)  # diffusers' mask: white where the image is repainted
    assert np.array_equal(decode_mask(png(grey), (6, 4)), square.astype(np.float32))
    with pytest.raises(ValueError, match=r"^mask: expected the image's size, 8x4, got 6x4$"):
        decode_mask(png(grey), (8, 4))
    with pytest.raises(ValueError, match=r"^mask: expected a PNG file, got 2 bytes of no image Pillow reads"):
        decode_mask(b"no", (6, 4))


def test_a_16_bit_grey_mask_is_light_against_its_own_range():
    from PIL import Image

    grey = np.zeros((4, 4), np.uint16)
    grey[:2] = 60000  # light
    grey[2, 0] = 4000  # dark in 16 bits, which an 8-bit conversion would clamp to white
    buffer = io.BytesIO()
    Image.fromarray(grey).save(buffer, format="PNG")
    mask = decode_mask(buffer.getvalue(), (4, 4))
    np.testing.assert_array_equal(mask, np.repeat([[1.0], [1.0], [0.0], [0.0]], 4, axis=1))


def test_a_body_nested_too_deep_is_refused_as_no_json():
    with pytest.raises(OpenAIError) as refused:
        openai_generation_request(b"[" * 200_000, "tiny")
    assert refused.value.status == 400 and refused.value.code == "invalid_json"


def test_an_image_in_a_format_beyond_png_jpeg_and_webp_is_refused_naming_the_field():
    from PIL import Image

    from optimum_iobinding.errors import ArgumentError
    from optimum_iobinding.serve.schema import decode_image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="GIF")
    with pytest.raises(ArgumentError, match="^image: expected a PNG or JPEG file"):
        decode_image(buffer.getvalue())


@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/images/edits"])
def test_another_method_on_an_openai_route_is_answered_in_openais_error_shape(path):
    """A GET of an OpenAI route was answered 405 as FastAPI answers, ``{"detail": "Method Not Allowed"}``; the
    service's own route keeps FastAPI's answer."""
    pytest.importorskip("ray", reason="needs the serve extra (ray[serve])")
    from fastapi.testclient import TestClient

    from optimum_iobinding.serve.app import api

    client = TestClient(api)
    answer = client.get(path)
    assert (answer.status_code, answer.headers["allow"]) == (405, "POST")
    assert answer.json() == {
        "error": {
            "message": "method: expected POST, got GET",
            "type": "invalid_request_error",
            "param": None,
            "code": "method_not_allowed",
        }
    }
    assert client.get("/v1/images").json() == {"detail": "Method Not Allowed"}
