"""Metrics through OpenTelemetry's API: with an SDK installed, a manager's counters, gauges and
histograms are collected (in a process of its own: the global meter provider is set once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from pulsar_state._types import LATENCY_BUCKETS_S, LatencyHistogram
from tests.support.broker import REPO, Broker

PROGRAM = textwrap.dedent(
    """
    import asyncio, json, sys
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    from tests.core.helpers import counter_manager, incr

    async def main(url, admin, topic):
        async with counter_manager(url, topic, admin) as manager:
            await asyncio.gather(*(manager.write(lambda s: [incr()]) for _ in range(5)))
            assert await manager.read(lambda s: s["count"], latest=True) == 5
            data = reader.get_metrics_data()
        found = {}
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        if point.attributes.get("topic") != topic:
                            continue
                        value = getattr(point, "value", None)
                        if value is None:  # a histogram point
                            value = point.count
                        found[metric.name] = found.get(metric.name, 0) + value
        print(json.dumps(found))

    asyncio.run(main(*sys.argv[1:4]))
    """
)


def test_an_sdk_collects_the_managers_metrics(broker: Broker, topic: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, broker.service_url, broker.admin_url, topic],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["pulsar_state.write.duration"] == 5  # one outcome per write, all committed
    assert found["pulsar_state.writes.committed"] == 5
    applied = found["pulsar_state.records.read"] - found.get("pulsar_state.records.rejected", 0)
    assert found["pulsar_state.apply.duration"] == applied
    assert found["pulsar_state.position"] == applied
    assert found["pulsar_state.halted"] == 0
    assert found["pulsar_state.writer.acquisitions"] == 1
    assert found["pulsar_state.tail_lag.records"] >= 0
    assert found["pulsar_state.replay.progress"] == 1.0  # open: the replay is done
    assert "pulsar_state.snapshot.age" not in found  # unknown: no sample, no sentinel
    assert "pulsar_state.writes.failed" not in found


def test_latency_histogram_buckets_are_cumulative() -> None:
    histogram = LatencyHistogram()
    for seconds in (0.00005, 0.003, 0.003, 1000.0):
        histogram.observe(seconds)
    cumulative = histogram.cumulative()
    assert len(cumulative) == len(LATENCY_BUCKETS_S) + 1
    assert cumulative[0] == (LATENCY_BUCKETS_S[0], 1)
    assert dict(cumulative)[0.005] == 3
    assert cumulative[-1] == (float("inf"), 4)
    assert histogram.count == 4
    assert abs(histogram.sum_s - 1000.00605) < 1e-9
