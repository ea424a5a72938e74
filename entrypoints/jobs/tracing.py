"""A job's trace: spans built from what the engine reports, and their OTLP/HTTP export.

The engine does not trace itself; each stage's final output says how long the request waited in
the stage's queue (``queue_wait_ms``), how long its wave ran (``execution_ms``), how much of that
was the VAE decode at its end (``decode_ms``), which wave it was (``batch_id``, ``batch_size``)
and when the stage finished (``finished_at``, the stage machine's clock). The gateway turns that
into spans when the output arrives: the wave ended at ``finished_at`` (or, from a clock ahead of
the gateway's, at arrival), began ``execution_ms`` earlier, and queued before that; from its end
to the output's arrival is the transfer (the stage's answer to the engine, and on to the gateway
or the next stage). Spans are plain dicts in the job record (``GET /v1/jobs/{id}/trace``);
with ``--otlp-endpoint`` they are also exported with opentelemetry-sdk, every stage span a child of
the job's span, which itself joins the caller's trace when the request carried ``traceparent``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def span(name: str, start_s: float, end_s: float, **attributes: Any) -> dict[str, Any]:
    """One span of a job's trace; times are epoch seconds."""
    return {
        "name": name,
        "start": round(start_s, 6),
        "end": round(max(start_s, end_s), 6),
        "duration_ms": round(max(0.0, end_s - start_s) * 1000.0, 3),
        "attributes": {k: v for k, v in attributes.items() if v is not None},
    }


def stage_spans(stage_id: int, done_s: float, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """The queue wait and the wave of one stage, from its output's metrics (arrived at ``done_s``)."""
    execution = _ms(metrics.get("execution_ms"))
    queue = _ms(metrics.get("queue_wait_ms"))
    admission = _ms(metrics.get("admission_wait_ms"))
    decode = _ms(metrics.get("decode_ms"))
    finished = metrics.get("finished_at")
    wave_end = min(float(finished), done_s) if isinstance(finished, int | float) and finished > 0 else done_s
    wave_start = wave_end - execution
    spans = [
        span(
            f"stage {stage_id} queue",
            wave_start - queue,
            wave_start,
            stage_id=stage_id,
            admission_wait_ms=admission,
        ),
        span(
            f"stage {stage_id} wave",
            wave_start,
            wave_end,
            stage_id=stage_id,
            batch_id=metrics.get("batch_id"),
            batch_size=metrics.get("batch_size"),
            replica_id=metrics.get("replica_id"),
            steps_run=metrics.get("steps_run"),
            time_to_first_step_ms=metrics.get("time_to_first_step_ms"),
        ),
    ]
    if decode:
        spans.append(span(f"stage {stage_id} decode", wave_end - decode, wave_end, stage_id=stage_id))
    if done_s > wave_end:
        spans.append(span(f"stage {stage_id} transfer", wave_end, done_s, stage_id=stage_id))
    return spans


def _ms(value: Any) -> float:
    return float(value) / 1000.0 if isinstance(value, int | float) and value > 0 else 0.0


class OtlpExporter:
    """Exports finished jobs' spans to an OTLP/HTTP endpoint (``.../v1/traces``), in batches from
    the SDK's own thread, so the server's loop never waits on the collector."""

    def __init__(self, endpoint: str, service_name: str = "omni-runtime") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if "/v1/" not in endpoint:
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5), schedule_delay_millis=500)
        )
        self.tracer = self.provider.get_tracer("omni_runtime.jobs")

    def export(self, root: dict[str, Any], children: Sequence[dict[str, Any]], traceparent: str | None) -> str:
        """Record the job's span and its children; returns the trace id (32 hex digits)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None
        job = self.tracer.start_span(
            root["name"],
            context=parent,
            kind=SpanKind.SERVER,
            start_time=_ns(root["start"]),
            attributes=root["attributes"],
        )
        inside = trace.set_span_in_context(job)
        for child in children:
            s = self.tracer.start_span(
                child["name"], context=inside, start_time=_ns(child["start"]), attributes=child["attributes"]
            )
            s.end(end_time=_ns(child["end"]))
        job.end(end_time=_ns(root["end"]))
        return format(job.get_span_context().trace_id, "032x")

    def close(self) -> None:
        self.provider.shutdown()  # flushes what is still batched


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
