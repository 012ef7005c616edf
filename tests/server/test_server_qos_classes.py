"""Request classes over HTTP, through the engine core process: `qos_class` picks a class, the
tenant's default applies without it; a class the tenant may not use is a 403 naming the field, an
unknown class a 400; /metrics has each class's targets and request counts."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

QOS = {"classes": {"gold": {"priority": 0, "ttft_p99": 5.0, "tpot_p99": 1.0, "on_miss": "shed",
                            "kv_reservation_blocks": 3},
                   "bronze": {"priority": 2, "ttft_p99": 60}},
       "default_class": "bronze",
       "tenants": {"free": {"classes": ["bronze"]}, "vip": {"default_class": "gold"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-classes"), max_position_embeddings=2048)
    qos = tmp_path_factory.mktemp("qos") / "qos.json"
    qos.write_text(json.dumps(QOS))
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20,
                                                scheduling_policy="priority", qos_config=str(qos)),
                            trust_request_tenant=True)
    yield server.url
    server.stop()


def _post(url: str, **fields) -> httpx.Response:
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_classes_by_field_and_by_tenant_default_and_refusals(server):
    assert _post(server, tenant="vip").status_code == 200                     # gold, its default
    assert _post(server, tenant="free", qos_class="bronze").status_code == 200
    assert _post(server).status_code == 200                                   # bronze, the config's default
    forbidden = _post(server, tenant="free", qos_class="gold")
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["param"] == "qos_class" and "tenant 'free'" in forbidden.json()["error"]["message"]
    unknown = _post(server, qos_class="platinum")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "qos_class"
    metrics = httpx.get(server + "/metrics").text
    finished = {line.split("qos_class=\"")[1].split("\"")[0]: float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("kvserve:qos_class_requests_total") and 'outcome="finished"' in line}
    assert finished == {"bronze": 2.0, "gold": 1.0}
    targets = [line for line in metrics.splitlines() if line.startswith("kvserve:qos_class_latency_target_seconds")]
    assert any('qos_class="gold"' in line and 'metric="tpot"' in line and line.endswith(" 1.0") for line in targets)
    kv = [line for line in metrics.splitlines() if line.startswith("kvserve:qos_class_kv_blocks")]
    assert any('qos_class="gold"' in line and 'kind="reserved"' in line and line.endswith(" 3.0") for line in kv)


def test_a_request_shed_in_the_queue_for_its_class_gets_an_overloaded_error_naming_the_target():
    # Shed in the queue by its class's target on a server with no TTFT target of its own: the
    # message (an SSE error once the stream has begun) says which target, instead of failing to format.
    from types import SimpleNamespace

    from kvserve.sched.slo import RequestOverloaded
    from kvserve.server.serving_base import OpenAIServing
    shed = SimpleNamespace(finished=True, outputs=[SimpleNamespace(finish_reason="rejected")])
    with pytest.raises(RequestOverloaded, match="within its class's TTFT target"):
        OpenAIServing._check_not_rejected(SimpleNamespace(slo_ttft=None), shed)
    with pytest.raises(RequestOverloaded, match="within the 2 s TTFT target"):
        OpenAIServing._check_not_rejected(SimpleNamespace(slo_ttft=2.0), shed)
