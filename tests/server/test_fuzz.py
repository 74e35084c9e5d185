"""A bounded run of the fuzz campaign (benchmarks/reliability/fuzz.py) for CI: generated bodies
per body-taking endpoint against a real server on the tiny Qwen artifact (tools, thinking and
effort tiers all renderable), checked by the campaign's own rules.

Positive cases come from the OpenAPI document narrowed by ninfer/testing/openapi_cases.py and
must be served; negative cases violate the served schema and must be refused with a 4xx that
names the field (or be served where the validator is more lenient than the schema); nothing
may answer 5xx, and the server must stay healthy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.server.conftest import serve_config, start_server

pytest.importorskip("schemathesis")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "reliability"))
import fuzz  # noqa: E402

CASES_PER_ENDPOINT = 50  # half positive, half negative: about half a minute on 2 CPU cores
OUTPUT_TOKENS = 2


@pytest.mark.slow
def test_generated_bodies_get_no_5xx_and_field_specific_4xx(tiny_qwen):
    import schemathesis

    from ninfer.testing.openapi_cases import accepted_document

    server = start_server(serve_config(tiny_qwen, default_max_tokens=OUTPUT_TOKENS, max_context=512))
    try:
        model_id = server.serving.model_id
        served = fuzz.httpx.get(server.base_url + "/openapi.json").json()
        served["components"]["schemas"]["ModelId"] = {"type": "string", "enum": [model_id]}
        campaign = fuzz.Campaign(server.base_url, None, served)
        paths = sorted(fuzz.GENERATED_BODY_PATHS)
        positive = schemathesis.openapi.from_dict(
            accepted_document(server.serving.capabilities, model_id, OUTPUT_TOKENS)
        ).include(path=paths)
        negative = schemathesis.openapi.from_dict(served).include(path=paths)
        campaign.generated(positive, "positive", schemathesis.GenerationMode.POSITIVE, CASES_PER_ENDPOINT // 2, 0)
        campaign.generated(negative, "negative", schemathesis.GenerationMode.NEGATIVE, CASES_PER_ENDPOINT // 2, 0)
        assert campaign.alive()
    finally:
        server.stop()
    for path in paths:
        assert sum(v for k, v in campaign.tallies[f"POST {path}"]["positive"].items() if not k.startswith("code:"))
    assert not campaign.findings, "\n".join(
        f"{f['count']}x {f['kind']} at {f['where']}: {f['detail']}\n  {f['examples'][0][:600]}"
        for f in campaign.findings.values()
    )
