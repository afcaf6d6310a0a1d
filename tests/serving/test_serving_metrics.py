"""/metrics: the DESIGN.md names, with values that match what the API reported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

NAMES = (
    "kvpool_prompt_tokens",
    "kvpool_generation_tokens",
    "kvpool_prefix_cache_queries",
    "kvpool_prefix_cache_hits",
    "kvpool_request_success",
    "kvpool_num_preemptions",
    "kvpool_num_requests_running",
    "kvpool_num_requests_waiting",
    "kvpool_kv_cache_usage_ratio",
    "kvpool_time_to_first_token_seconds",
    "kvpool_inter_token_latency_seconds",
    "kvpool_e2e_request_latency_seconds",
    "kvpool_kv_fetch_decisions",
    "kvpool_kv_fetch_ties",
    "kvpool_kv_fetch_predicted_seconds",
    "kvpool_kv_fetch_realized_seconds",
)


def _scrape(client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_metrics_after_requests(client):
    before = _scrape(client)
    assert "kvpool_decode_step_weight_bytes" not in before  # no decode step yet
    assert before["kvpool_prompt_tokens_total"] == 0
    assert before["kvpool_kv_cache_usage_ratio"] == 0
    text = client.get("/metrics").text
    for name in NAMES:
        assert name in text, name

    prompt = "metrics are counted in tokens " * 2
    usages = [
        client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": n, "ignore_eos": True}
        ).json()["usage"]
        for n in (3, 5)
    ]
    m = _scrape(client)
    assert m["kvpool_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert m["kvpool_generation_tokens_total"] == 8
    assert m["kvpool_prefix_cache_queries_total"] == 2 * len(prompt)
    assert (
        m["kvpool_prefix_cache_hits_total"]
        == usages[1]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )
    assert m["kvpool_request_success_total{finish_reason=length}"] == 2
    assert m["kvpool_num_preemptions_total"] == 0
    assert m["kvpool_kv_fetch_decisions_total{decision=load}"] == 0  # no connector here
    assert m["kvpool_num_requests_running"] == 0 and m["kvpool_num_requests_waiting"] == 0
    assert m["kvpool_kv_cache_usage_ratio"] == 0
    assert m["kvpool_time_to_first_token_seconds_count"] == 2
    assert 0 < m["kvpool_time_to_first_token_seconds_sum"] < 30
    assert m["kvpool_inter_token_latency_seconds_count"] == 2 + 4
    assert m["kvpool_e2e_request_latency_seconds_count"] == 2
    # the decode roofline: the last decode-only step read the weights and one sequence's KV
    assert m["kvpool_decode_batch_size"] == 1
    assert m["kvpool_decode_step_weight_bytes"] > 0 and m["kvpool_decode_step_kv_bytes"] > 0
    assert m["kvpool_decode_bandwidth_bytes_per_second"] > 0
    assert m["kvpool_decode_tokens_per_second"] > 0
    assert (
        m["kvpool_e2e_request_latency_seconds_sum"] >= m["kvpool_time_to_first_token_seconds_sum"]
    )


def test_registries_are_per_app(make_app):
    from fastapi.testclient import TestClient

    _, app1 = make_app()
    _, app2 = make_app()
    with TestClient(app1) as c1, TestClient(app2) as c2:
        c1.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        assert _scrape(c1)["kvpool_prompt_tokens_total"] == 3
        assert _scrape(c2)["kvpool_prompt_tokens_total"] == 0
