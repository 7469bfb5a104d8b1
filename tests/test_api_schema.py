"""The API description is the API: schemathesis over every operation of a real server's
/openapi.json finds no server error and no response that disagrees with the description; the
error table of docs/http-api.md and the error classes agree with the statuses the API documents.
"""

from __future__ import annotations

import re
import time

import pytest

from cag.api.errors import STATUSES, status_of
from tests.conftest import REPO
from tests.test_api import KEY, served_notes

AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 15  # per operation and generation mode: 10 operations x 2 modes x 15 cases, ~10 s


@pytest.fixture(scope="module")
def schema_server(tiny_model_dir, models_dir, tmp_path_factory):
    """Answers of at most 4 tokens (CAG_ANSWER_ROOM): every generated request that reaches the model
    is short. Four workers and a long queue: the fuzzer is never refused for load (429)."""
    with served_notes(tmp_path_factory.mktemp("schema"), tiny_model_dir, models_dir, CAG_API_KEYS=KEY,
                      CAG_ANSWER_ROOM="4", CAG_MAX_TOKENS="4", CAG_WORKERS="4", CAG_MAX_QUEUE="64") as (srv, *_):
        yield srv


def _aim(case) -> None:
    """Point a generated case at the real corpus so that it reaches the model: random names alone
    only ever meet 404."""
    for k in ("name", "model"):
        if case.path_parameters and k in case.path_parameters:
            case.path_parameters[k] = "notes"
    if isinstance(case.body, dict):
        for k in ("corpus", "model"):
            if isinstance(case.body.get(k), str):
                case.body[k] = "notes"
        if isinstance(case.body.get("messages"), list):
            case.body["messages"].append({"role": "user", "content": "What does the fuzzer want?"})


def test_every_operation_conforms_to_the_openapi_description(schema_server):
    """Every built-in schemathesis check (server errors, status codes, content types, response
    schemas, event-stream items and headers, negative data rejected, auth not ignored ...) on valid
    and invalid inputs for every operation, half the valid ones aimed at the real corpus.

    Valid data is held to a sharper rule than schemathesis's own `positive_data_acceptance`: the
    request validation (400 invalid_request) never refuses what the description allows. Rules no
    JSON schema states answer with their own documented codes and pass: a blank question or no
    user message (400 bad_request), a question over the configured limits (413)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    url = schema_server.url
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    t0 = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 10, [op.label for op in operations]
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            counter = iter(range(10**6))

            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                if mode == GenerationMode.POSITIVE and next(counter) % 2:
                    _aim(case)
                try:
                    response = case.call_and_validate(base_url=url, headers=AUTH, timeout=60,
                                                      excluded_checks=[positive_data_acceptance])
                except FailureGroup as e:  # collected, so that one run reports every operation
                    failures.append(f"{op.label} [{mode.value}]: {e}\n{case.as_curl_command(headers=AUTH)}")
                    return
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if mode == GenerationMode.POSITIVE and response.status_code == 400 and \
                        response.json()["error"]["code"] == "invalid_request":
                    failures.append(f"{op.label}: schema-valid input refused by validation: {response.text}\n"
                                    f"{case.as_curl_command(headers=AUTH)}")

            try:
                check()
            except Unsatisfiable:  # an operation that takes no input has no invalid input
                assert mode == GenerationMode.NEGATIVE, op.label
    assert not failures, f"{len(failures)} failures:\n\n" + "\n\n".join(failures[:8])
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10 and statuses.get(404, 0) >= 1, statuses
    assert not [s for s in statuses if s >= 500], statuses
    assert time.monotonic() - t0 < 60


# -- the error statuses: code, docs/http-api.md and description agree ------------------------------
def _error_classes():
    import cag.api.errors
    import cag.errors

    seen, todo = [], [cag.errors.CagError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in seen if c.__module__ in (cag.errors.__name__, cag.api.errors.__name__)]


def test_every_error_class_has_its_status_and_code_in_the_table():
    from cag.errors import BadSettings

    for cls in _error_classes():
        if cls is BadSettings:  # settings are read before the server answers anything
            continue
        status = status_of(cls)
        assert status in STATUSES and cls.code in STATUSES[status][0], (cls.__name__, status, cls.code)
    assert status_of(__import__("cag.errors").errors.SnapshotCorrupt) == 503


def test_the_documented_error_table_lists_every_status_and_code():
    text = (REPO / "docs" / "http-api.md").read_text()
    section = text[text.index("## Errors"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `?(\d{3})`? \| ([^|]+) \|", section, flags=re.M)
    table = {int(status): {c.strip(" `") for c in codes.split(",")} for status, codes in rows}
    assert table == {status: set(codes) for status, (codes, _) in STATUSES.items()}


def test_the_description_documents_streams_metrics_and_errors(tiny_model_dir, monkeypatch):
    from cag.api.app import create_app
    from cag.api.settings import ApiSettings
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    spec = create_app(ApiSettings(api_keys=KEY), engine=Engine(get_settings())).openapi()
    paths = spec["paths"]
    for path in ("/v1/ask", "/v1/chat/completions"):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path
        assert "snapshot_corrupt" in paths[path]["post"]["responses"]["503"]["description"]
    metrics = paths["/metrics"]["get"]["responses"]
    assert list(metrics["200"]["content"]) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert list(metrics["401"]["content"]) == ["application/json"]  # errors are JSON, also here
    assert "security" not in paths["/health"]["get"]
    documented = {int(s) for ops in paths.values() for op in ops.values() for s in op["responses"]}
    assert documented - {200, 202} <= set(STATUSES)
    assert {"HTTPValidationError", "ValidationError"}.isdisjoint(spec["components"]["schemas"])
    ask = spec["components"]["schemas"]["AskRequest"]["properties"]
    assert ask["include_token_ids"]["type"] == "boolean"
    seed = spec["components"]["schemas"]["ChatRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed == {"type": "integer"}  # any integer, reduced modulo 2**64 by the server


def test_blank_api_keys_are_a_start_up_error_not_an_open_server(monkeypatch):
    import subprocess

    from bench.harness import cag_command
    from cag.api.settings import ApiSettings, load_api_settings
    from cag.errors import BadSettings

    assert ApiSettings().keys == []  # unset: no authentication, on purpose
    assert ApiSettings(api_keys=" a ,, b ").keys == ["a", "b"]
    for blank in (" , ", "", ",", "   "):
        monkeypatch.setenv("CAG_API_KEYS", blank)
        with pytest.raises(BadSettings, match="CAG_API_KEYS"):
            load_api_settings()
    r = subprocess.run(
        [*cag_command(), "serve", "--port", "1"],
        env={**__import__("os").environ, "CAG_API_KEYS": " , "},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "CAG_API_KEYS" in r.stderr and "Traceback" not in r.stderr
