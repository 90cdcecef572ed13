"""The error table (kvfleet.contracts.errors): every row complete, exceptions looked up in it.

The front doors (gRPC interceptor, HTTP error JSON, metrics labels) only read this table, so
pinning it here pins what clients see on both.
"""

from __future__ import annotations

import pickle

import grpc
import pytest

from kvfleet.contracts import errors
from kvfleet.contracts.errors import (
    ERROR_KINDS,
    InvalidFieldError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    failure_of,
)
from kvfleet.contracts.sampling_params import SamplingParams
from router.http.errors import ERROR_TYPES, error_body, status_of
from router.tenancy.api_keys import AuthenticationError


class _Downstream(grpc.RpcError):
    """A client-side RpcError as a downstream call raises it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_every_kind_has_a_grpc_code_an_http_status_and_an_openai_type() -> None:
    assert len({kind.name for kind in ERROR_KINDS}) == len(ERROR_KINDS)
    assert len({kind.http_status for kind in ERROR_KINDS}) == len(ERROR_KINDS)
    for kind in ERROR_KINDS:
        assert isinstance(kind.grpc_code, grpc.StatusCode) and kind.grpc_code.name != "OK"
        assert 400 <= kind.http_status < 600 and kind.openai_type.endswith("Error")
        assert kind.default_message
        assert error_body(kind.http_status, "m")["error"] == {
            "message": "m", "type": kind.openai_type, "param": None, "code": kind.http_status}


def test_the_rows_clients_see() -> None:
    rows = {(k.grpc_code.name, k.http_status, k.openai_type, k.names_field) for k in ERROR_KINDS}
    assert rows == {
        ("INVALID_ARGUMENT", 400, "BadRequestError", True),
        ("INVALID_ARGUMENT", 413, "RequestTooLargeError", True),
        ("INVALID_ARGUMENT", 415, "UnsupportedMediaTypeError", False),
        ("PERMISSION_DENIED", 403, "PermissionDeniedError", False),
        ("DEADLINE_EXCEEDED", 408, "RequestTimeoutError", False),
        ("UNAUTHENTICATED", 401, "AuthenticationError", False),
        ("NOT_FOUND", 404, "NotFoundError", False),
        ("UNIMPLEMENTED", 405, "MethodNotAllowedError", False),
        ("RESOURCE_EXHAUSTED", 429, "RateLimitError", False),
        ("UNAVAILABLE", 503, "ServiceUnavailableError", False),
        ("CANCELLED", 499, "InternalServerError", False),
        ("UNIMPLEMENTED", 501, "InternalServerError", False),
        ("DEADLINE_EXCEEDED", 504, "InternalServerError", False),
        ("INTERNAL", 500, "InternalServerError", False),
    }
    # What the OpenAPI document lists: the statuses with a type of their own.
    assert ERROR_TYPES == {400: "BadRequestError", 401: "AuthenticationError",
                           403: "PermissionDeniedError", 415: "UnsupportedMediaTypeError",
                           404: "NotFoundError", 405: "MethodNotAllowedError",
                           408: "RequestTimeoutError", 413: "RequestTooLargeError",
                           429: "RateLimitError", 503: "ServiceUnavailableError"}
    assert error_body(418, "m")["error"]["type"] == "InternalServerError"


@pytest.mark.parametrize(("exc", "code", "status"), [
    (InvalidFieldError("stop", "stop has 9 strings"), "INVALID_ARGUMENT", 400),
    (InvalidFieldError(None, "too big", 413), "INVALID_ARGUMENT", 413),
    (ValueError("bad"), "INVALID_ARGUMENT", 400),
    (AuthenticationError("invalid API key"), "UNAUTHENTICATED", 401),
    (UnauthenticatedError("no key"), "UNAUTHENTICATED", 401),
    (NotFoundError("model"), "NOT_FOUND", 404),
    (PermissionDeniedError("admin only"), "PERMISSION_DENIED", 403),
    (InvalidFieldError(None, "not JSON", 415), "INVALID_ARGUMENT", 415),
    (OverloadedError("full"), "RESOURCE_EXHAUSTED", 429),
    (UnavailableError("none"), "UNAVAILABLE", 503),
])
def test_exceptions_find_their_row(exc: Exception, code: str, status: int) -> None:
    failure = failure_of(exc)
    assert (failure.grpc_code.name, failure.http_status) == (code, status)
    assert failure.message == str(exc) and not failure.unexpected


def test_the_field_passes_through_from_where_it_is_raised() -> None:
    assert failure_of(InvalidFieldError("messages[1].role", "bad role")).param == (
        "messages[1].role")
    assert failure_of(InvalidFieldError(None, "not JSON")).param is None
    with pytest.raises(InvalidFieldError) as caught:
        SamplingParams(temperature=-1.0)
    assert caught.value.param == "temperature"
    assert status_of(caught.value) == (400, str(caught.value), "temperature")
    # Only rows that name a field give a param, whatever the exception carries.
    assert failure_of(NotFoundError("temperature is unknown")).param is None
    # It survives pickling (e.g. to another process).
    copy = pickle.loads(pickle.dumps(InvalidFieldError("n", "n too big", 413)))
    assert (copy.param, str(copy), copy.http_status) == ("n", "n too big", 413)
    with pytest.raises(TypeError):
        InvalidFieldError("n", "no such row", 404)


def test_field_less_errors_fall_back_to_the_leading_body_field() -> None:
    assert failure_of(ValueError("top_p must be in (0, 1]")).param == "top_p"
    assert failure_of(ValueError("the chat template rejected it")).param is None
    relayed = failure_of(_Downstream(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"))
    assert (relayed.http_status, relayed.param) == (400, "prompt")


def test_unknown_exceptions_are_internal_and_say_nothing() -> None:
    failure = failure_of(RuntimeError("secret detail"))
    assert failure.kind is errors.INTERNAL and failure.unexpected
    assert (failure.grpc_code, failure.http_status) == (grpc.StatusCode.INTERNAL, 500)
    assert failure.message == "internal error" and failure.param is None
    assert failure_of(KeyError("x")).http_status == 500  # a LookupError, not NotFoundError


def test_downstream_statuses_are_relayed() -> None:
    for code, status in [("INVALID_ARGUMENT", 400), ("NOT_FOUND", 404),
                         ("RESOURCE_EXHAUSTED", 429), ("CANCELLED", 499), ("INTERNAL", 500),
                         ("UNIMPLEMENTED", 501), ("UNAVAILABLE", 503),
                         ("DEADLINE_EXCEEDED", 504),
                         # The router's own credentials refused: not the client's fault.
                         ("UNAUTHENTICATED", 500), ("PERMISSION_DENIED", 500)]:
        failure = failure_of(_Downstream(grpc.StatusCode[code], "details"))
        assert failure.grpc_code.name == code and failure.message == "details"
        assert failure.http_status == status, code
        assert failure.unexpected == (code == "INTERNAL")
    assert failure_of(_Downstream(grpc.StatusCode.OK, "")).message == "internal error"


def test_extra_answers_come_from_the_exception() -> None:
    class Retry(OverloadedError):
        def http_headers(self) -> dict[str, str]:
            return {"retry-after": "2"}

        def grpc_trailing_metadata(self) -> list[tuple[str, str | bytes]]:
            return [("retry-after", "2")]

    failure = failure_of(Retry("slow down"))
    assert failure.http_headers == {"retry-after": "2"}
    assert failure.grpc_trailing_metadata == (("retry-after", "2"),)
    assert failure_of(ValueError("x")).grpc_trailing_metadata == ()
