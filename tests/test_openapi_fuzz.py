"""schemathesis over /openapi.json against a real server (a tiny random BERT): generated requests for every
operation never get a 5xx, and every response matches the document (status code, content type, body schema)."""

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from checkpoints import build_bert  # noqa: E402
from server import Server  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_bert(tmp_path_factory.mktemp("bert"), layers=1, hidden=32)
    srv = Server([str(path), "--api-key", "k", "--served-model-name", "m"], tmp_path_factory.mktemp("log") / "log")
    yield srv
    srv.stop()


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_get_no_5xx_and_match_the_document(case, server):
    case.call_and_validate(base_url=server.url, headers={"Authorization": "Bearer k"}, checks=CHECKS)
