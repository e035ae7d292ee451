"""``/metrics``' families of a server's prefill/decode part (``serve --role``; metrics
Rule 9), built at each scrape from :class:`~inference_lab.serve.kv_transfer.KVConnector`.

- a prefill server: ``inference_lab:kv_held_requests`` (gauge: holds now),
  ``inference_lab:kv_holds`` (holds made), ``inference_lab:kv_holds_ended`` (label
  ``reason``: released, expired, undelivered, stopped) and ``inference_lab:kv_claims``
  (label ``outcome``: accepted, refused);
- a decode server: ``inference_lab:kv_pulls`` (label ``outcome``: claimed, refused),
  ``inference_lab:kv_pull_releases`` (label ``outcome``: sent, failed), and its engine's
  transfers: ``inference_lab:kv_transfers``, ``inference_lab:kv_transfer_bytes``,
  ``inference_lab:kv_transfer_seconds`` (counters) and ``inference_lab:kv_receiving_requests``
  (gauge: requests whose KV is on its way).

Every family is labelled ``model_name``; a server of role ``both`` exports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.kv_holds import END_REASONS, KVHolds
from inference_lab.serve.kv_pulls import KVPulls, PullCounts
from inference_lab.serve.kv_transfer import KVConnector

__all__ = ["kv_families"]

_LABEL = ["model_name"]


def kv_families(kv: KVConnector, runtimes: Mapping[str, ModelRuntime]) -> Iterator[Metric]:
    """The families of ``kv``'s role, one sample per served model."""
    models = list(runtimes)
    if kv.holds is not None:
        yield from _hold_families(kv.holds, models)
    if kv.pulls is not None:
        yield from _pull_families(kv.pulls, models)
        yield from _transfer_families(runtimes)


def _transfer_families(runtimes: Mapping[str, ModelRuntime]) -> Iterator[Metric]:
    """The KV a decode server's engines received (their own counters, alive or not) and
    the requests receiving now."""
    families = (
        CounterMetricFamily(
            "inference_lab:kv_transfers",
            "KV transfers received from a remote prefill (do_remote_prefill).",
            labels=_LABEL,
        ),
        CounterMetricFamily(
            "inference_lab:kv_transfer_bytes",
            "Bytes of KV received from remote prefills (over the profile's link).",
            labels=_LABEL,
        ),
        CounterMetricFamily(
            "inference_lab:kv_transfer_seconds",
            "Seconds the KV transfers from remote prefills took, summed.",
            labels=_LABEL,
        ),
    )
    receiving = GaugeMetricFamily(
        "inference_lab:kv_receiving_requests",
        "Requests admitted whose remote prefill's KV is on its way.",
        labels=_LABEL,
    )
    for name, runtime in runtimes.items():
        stats = runtime.engine.statistics()
        values = (stats.transfers, stats.transfer_bytes, stats.transfer_seconds)
        for family, value in zip(families, values, strict=True):
            family.add_metric([name], value)
        alive = runtime.snapshot().alive
        receiving.add_metric([name], sum(w.receiving for w in stats.workers) if alive else 0)
    yield from families
    yield receiving


def _hold_families(holds: KVHolds, models: Sequence[str]) -> Iterator[Metric]:
    held = GaugeMetricFamily(
        "inference_lab:kv_held_requests",
        "Finished requests whose KV is held for a decode server (do_remote_decode).",
        labels=_LABEL,
    )
    made = CounterMetricFamily(
        "inference_lab:kv_holds", "Requests that finished holding their KV.", labels=_LABEL
    )
    ended = CounterMetricFamily(
        "inference_lab:kv_holds_ended",
        "Holds ended: released by a decode server, expired (--kv-hold-timeout), "
        "undelivered (the answer never reached its client) or stopped (the engine stopped).",
        labels=[*_LABEL, "reason"],
    )
    claims = CounterMetricFamily(
        "inference_lab:kv_claims",
        "Claims by decode servers on held KV, accepted or refused (unknown, stale or "
        "mismatched params).",
        labels=[*_LABEL, "outcome"],
    )
    for model in models:
        counts = holds.counts[model]
        held.add_metric([model], holds.held(model))
        made.add_metric([model], counts.held)
        for reason in END_REASONS:
            ended.add_metric([model, reason], counts.ended[reason])
        claims.add_metric([model, "accepted"], counts.claims)
        claims.add_metric([model, "refused"], counts.claims_refused)
    yield from (held, made, ended, claims)


def _pull_families(pulls: KVPulls, models: Sequence[str]) -> Iterator[Metric]:
    claimed = CounterMetricFamily(
        "inference_lab:kv_pulls",
        "Claims this decode server made on prefill servers' KV, by outcome.",
        labels=[*_LABEL, "outcome"],
    )
    releases = CounterMetricFamily(
        "inference_lab:kv_pull_releases",
        "Releases this decode server sent to prefill servers once the KV arrived (or its "
        "request ended), by outcome.",
        labels=[*_LABEL, "outcome"],
    )
    for model in models:
        counts = pulls.counts.get(model, PullCounts())
        claimed.add_metric([model, "claimed"], counts.claims)
        claimed.add_metric([model, "refused"], counts.claims_refused)
        releases.add_metric([model, "sent"], counts.releases)
        releases.add_metric([model, "failed"], counts.releases_failed)
    yield from (claimed, releases)
