"""One API, one table (``server.http.api``): both processes serve exactly its routes, its
OpenAPI document and ``docs/api.md`` describe exactly them, and a new session's request
is read the same way wherever it arrives."""

from __future__ import annotations

import re

import pytest

from server.config import REPO_ROOT, load_settings
from server.http.api import ROUTES, Owner, openapi
from server.http.errors import ApiError
from server.http.new_session import new_session_kind, parse_new_session, parse_whip_query
from server.session_spec import NewSession, RoomRequest, SessionKind

pytestmark = pytest.mark.unit


def _served(app) -> set[tuple[str, str]]:
    return {(route.method, route.resource.canonical) for route in app.router.routes()
            if route.method != "HEAD" and not route.resource.canonical.startswith("/static")}


TABLE = {route.key for route in ROUTES}


def test_a_server_alone_serves_the_table_and_a_worker_behind_the_door_its_internal_routes_too():
    from server.worker.app import create_app

    settings = load_settings()
    assert _served(create_app(settings)) == TABLE
    internal = _served(create_app(settings, behind_door=True)) - TABLE
    assert internal and all(path.startswith("/internal/") for _, path in internal)


def test_the_front_door_serves_the_table_and_nothing_else():
    from server.front_door.app import create_front_door
    from server.front_door.door import front_door_key

    app = create_front_door(load_settings())
    try:
        assert _served(app) == TABLE
    finally:
        import asyncio

        asyncio.run(app[front_door_key].processes.stop())  # its temporary folder


def test_every_route_has_one_owner_and_a_session_s_routes_name_the_session():
    assert len(TABLE) == len(ROUTES)
    for route in ROUTES:
        if route.owner is Owner.HOLDER:
            assert "{session_id}" in route.path, route


def test_the_openapi_document_describes_exactly_the_table():
    document = openapi("test")
    described = {(method.upper(), path) for path, operations in document["paths"].items()
                 for method in operations}
    assert described == TABLE
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    whep = document["paths"]["/sessions/{session_id}/whep/{viewer_id}"]["delete"]
    assert [p["name"] for p in whep["parameters"]] == ["session_id", "viewer_id"]


def test_the_api_reference_documents_every_route_and_no_other():
    text = (REPO_ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^#+ `(GET|POST|PATCH|DELETE|OPTIONS) (/[^`]*)`", text,
                                re.MULTILINE))
    assert documented == TABLE, (TABLE - documented, documented - TABLE)


def _refusal(call) -> tuple[int, str]:
    with pytest.raises(ApiError) as error:
        call()
    return error.value.status_code, error.value.code


def test_a_new_session_is_read_once_into_a_typed_request_that_crosses_to_the_worker_whole():
    settings = load_settings(overrides={"janus.url": "http://127.0.0.1:8088/janus"})
    body = {"avatar": "astronaut", "options": {"size": 512, "motion_scale": 1.5},
            "name": "lobby", "token": "t" * 24,
            "janus": {"room": 1234, "listen_to": "Alice"}}
    spec = parse_new_session(body, settings, new_session_kind(body))
    assert spec == NewSession(SessionKind.ROOM, "astronaut", 512, {"motion_scale": 1.5},
                              name="lobby", token="t" * 24,
                              room=RoomRequest(1234, "Alice"))
    assert NewSession.from_dict(spec.to_dict()) == spec
    hosted = parse_new_session({}, settings, new_session_kind({}))
    assert (hosted.kind, hosted.avatar, hosted.size) == (SessionKind.HOSTED, None, 256)
    whip = parse_whip_query({"size": "512", "motion_scale": "0.5", "record": "no"}, settings)
    assert (whip.kind, whip.size, whip.options, whip.record) == (
        SessionKind.PUBLISHER, 512, {"motion_scale": 0.5}, False)


@pytest.mark.parametrize("body, refused", [
    ({"options": []}, (400, "invalid_options")),
    ({"options": {"size": 300}}, (400, "invalid_options")),
    ({"size": True}, (400, "invalid_options")),
    ({"options": {"motion_scale": 9}}, (400, "invalid_options")),
    ({"options": {"tilt": 1}}, (400, "invalid_options")),
    ({"options": {"motion_only": "yes"}}, (400, "invalid_options")),
    ({"options": {"record": True}}, (400, "recording_off")),
    ({"avatar": 7}, (400, "invalid_avatar")),
    ({"name": "a b"}, (400, "invalid_name")),
    ({"token": "short"}, (400, "invalid_token")),
    ({"janus": {"room": 1, "listen_to": "A"}}, (400, "janus_off")),
])
def test_a_bad_new_session_is_refused_naming_the_problem(body, refused):
    settings = load_settings()
    assert _refusal(lambda: parse_new_session(body, settings, new_session_kind(body))) \
        == refused


def test_a_whip_url_with_a_knob_that_is_not_a_number_is_refused():
    assert _refusal(lambda: parse_whip_query({"motion_scale": "loud"}, load_settings())) \
        == (400, "invalid_options")
