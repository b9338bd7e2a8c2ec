"""Prometheus metrics of one or more shards, read from their status files (``docs/status.md``).

:class:`StatusCollector` is a prometheus-client custom collector: every scrape takes one
:class:`~transport.StatusReader` snapshot per shard (a copy of shared memory; nothing is asked
of the shard, nothing waits on it) and turns it into metric families. :func:`serve_metrics`
serves a registry holding one over HTTP (prometheus-client's own server, on a thread).

Every metric carries a ``shard`` label (the shard index). Names, types and labels are listed in
docs/status.md; ``docs/grafana/leasehold.json`` is a dashboard over them.
"""

import logging
import os
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from transport._status import StatusError, StatusReader

__all__ = ["StatusCollector", "MetricsServer", "serve_metrics", "METRIC_NAMES"]

log = logging.getLogger("leasehold.metrics")

#: Every metric family the collector exports: name -> (type, labels besides ``shard``, help).
METRIC_NAMES = {
    "leasehold_shard_up": ("gauge", (), "1 when the status file was read, the shard says it is "
                           "running and its pid is alive; else 0"),
    "leasehold_status_age_seconds": ("gauge", (), "Seconds since the shard last published"),
    "leasehold_shard_start_time_seconds": ("gauge", (), "When the shard made its status file "
                                           "(Unix time)"),
    "leasehold_shard_last_turn_time_seconds": ("gauge", (), "When the shard's last loop turn "
                                               "ended (Unix time; 0 before the first)"),
    "leasehold_reload_seconds": ("gauge", (), "How long the shard's engine took to load its "
                                 "state from the store at start"),
    "leasehold_tick_latency_seconds": ("histogram", (), "Wall time of one tick "
                                       "(Engine.schedule() in the shard loop)"),
    "leasehold_commit_latency_seconds": ("histogram", (), "Wall time of one store group commit "
                                         "(one transaction and sync per loop turn)"),
    "leasehold_commits": ("counter", (), "Store group commits"),
    "leasehold_commit_failures": ("counter", (), "Store group commits that failed"),
    "leasehold_ticks": ("counter", (), "Ticks the engine ran"),
    "leasehold_loop_turns": ("counter", (), "Loop turns of the shard"),
    "leasehold_loop_seconds": ("counter", ("part",), "Where the shard loop's time went: "
                               "decide (messages handled, tick, drain, group encoded), "
                               "commit (store group commits with their sync), send (a "
                               "committed turn's answers, leases and events)"),
    "leasehold_messages_received": ("counter", (), "Messages the shard took off its socket"),
    "leasehold_leases_pushed": ("counter", (), "Leases sent down worker streams"),
    "leasehold_leases_unsent": ("counter", (), "Leases that could not be sent (worker gone or "
                                "at its high-water mark); they expire and are reassigned"),
    "leasehold_dispatches": ("counter", ("queue",), "Leases handed out from the queue after "
                             "their commit (run and finalize); rate() is the dispatch rate"),
    "leasehold_queue_wait_seconds": ("histogram", ("queue", "reason"), "Enqueue of an "
                                     "attempt to its assignment, per run lease handed out; "
                                     "reason is the wait code that held the action just "
                                     "before the tick that placed it (NONE: no tick held it, "
                                     "placed by the first tick after its enqueue)"),
    "leasehold_queue_depth": ("gauge", ("queue",), "Queued actions"),
    "leasehold_queue_actions_in_flight": ("gauge", ("queue",), "Actions of the queue in "
                                          "flight"),
    "leasehold_queue_runs_in_flight": ("gauge", ("queue",), "Runs with work of the queue in "
                                       "flight"),
    "leasehold_queue_resources_in_flight": ("gauge", ("queue", "resource"), "Resources the "
                                            "queue's leases hold (cpu in millicores, memory "
                                            "and disk in bytes, devices whole)"),
    "leasehold_queue_head_blocked": ("gauge", ("queue", "reason"), "1 while the queue's head "
                                     "waits; reason is its wait code"),
    "leasehold_queue_head_blocked_seconds": ("gauge", ("queue", "reason"), "How long the "
                                             "waiting head has been the head"),
    "leasehold_queue_head_eta_seconds": ("gauge", ("queue",), "Estimated seconds until the "
                                         "waiting STRICT_FIFO head starts (predicted ends); "
                                         "absent when unknown"),
    "leasehold_queue_backfilled": ("counter", ("queue",), "Placements made by EASY backfill"),
    "leasehold_cluster_capacity": ("gauge", ("cluster", "resource"), "Configured capacity "
                                   "(+Inf: unknown or unlimited)"),
    "leasehold_cluster_resources_in_flight": ("gauge", ("cluster", "resource"), "Resources "
                                              "charged to the cluster by leases in flight"),
    "leasehold_cluster_free": ("gauge", ("cluster", "resource"), "What the tick may still "
                               "place: capacity less in flight, capped by what workers report "
                               "(+Inf: unlimited)"),
    "leasehold_cluster_leases_in_flight": ("gauge", ("cluster",), "Leases its workers hold"),
    "leasehold_cluster_workers_connected": ("gauge", ("cluster",), "Connected workers"),
    "leasehold_cluster_slots": ("gauge", ("cluster",), "Slots of its connected workers"),
    "leasehold_cluster_dispatches": ("counter", ("cluster",), "Leases placed on the cluster"),
    "leasehold_heartbeat_refusals": ("counter", ("verdict",), "Tokens a heartbeat presented "
                                     "that the shard refused, by verdict"),
    "leasehold_report_refusals": ("counter", ("verdict",), "Tokens a report presented that the "
                                  "shard refused, by verdict"),
    "leasehold_errors": ("counter", ("kind",), "ERROR replies the shard sent, by wire code"),
}

_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
           "histogram": HistogramMetricFamily}
_INF = float("inf")


def _value(v):
    return _INF if v is None else float(v)


def _buckets(hist):
    return [(floatToGoString(edge), float(n)) for edge, n in hist.cumulative()]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's process: it exists
        return True
    return True


class StatusCollector(Collector):
    """A prometheus-client collector over the status files at ``paths`` (one per shard).

    Register it with a ``CollectorRegistry``; each ``collect()`` reads one snapshot per file.
    A file that cannot be read (missing while its shard restarts, another layout, a writer
    stuck mid-publish) gives ``leasehold_shard_up 0`` for that shard, is logged, and the others
    are still exported. Safe to call from several scrape threads at once."""

    def __init__(self, paths, *, timeout=0.05):
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("StatusCollector: no status files given")
        self.timeout = float(timeout)
        self._readers = {}
        self._lock = threading.Lock()      # readers are not shared between scrapes

    def snapshots(self):
        """``[(path, StatusSnapshot or the StatusError that stopped its read), ...]``."""
        out = []
        with self._lock:
            for path in self.paths:
                try:
                    reader = self._readers.get(path)
                    if reader is None:
                        reader = self._readers[path] = StatusReader(path, timeout=self.timeout)
                    out.append((path, reader.snapshot()))
                except StatusError as exc:
                    bad = self._readers.pop(path, None)
                    if bad is not None:
                        bad.close()
                    out.append((path, exc))
        return out

    def describe(self):
        return [_FAMILY[kind](name, doc, labels=("shard", *labels))
                for name, (kind, labels, doc) in METRIC_NAMES.items()]

    def collect(self):
        fam = {name: _FAMILY[kind](name, doc, labels=("shard", *labels))
               for name, (kind, labels, doc) in METRIC_NAMES.items()}
        now = time.time_ns()
        for path, snap in self.snapshots():
            if isinstance(snap, StatusError):
                log.warning("metrics: %s", snap)
                shard = path.stem.removeprefix("shard-")
                fam["leasehold_shard_up"].add_metric([shard], 0.0)
                continue
            self._add(fam, snap, now)
        yield from fam.values()

    def _add(self, fam, s, now):
        sh = str(s.shard_index)
        up = s.state == "running" and _alive(s.pid)
        fam["leasehold_shard_up"].add_metric([sh], 1.0 if up else 0.0)
        fam["leasehold_status_age_seconds"].add_metric([sh], max(0, now - s.published_ns) / 1e9)
        fam["leasehold_shard_start_time_seconds"].add_metric([sh], s.start_ns / 1e9)
        fam["leasehold_shard_last_turn_time_seconds"].add_metric([sh], s.last_turn_ns / 1e9)
        fam["leasehold_reload_seconds"].add_metric([sh], s.reload_s)
        for name, hist in (("leasehold_tick_latency_seconds", s.tick_latency),
                           ("leasehold_commit_latency_seconds", s.commit_latency)):
            fam[name].add_metric([sh], _buckets(hist), hist.sum)
        for name, value in (("leasehold_commits", s.commits),
                            ("leasehold_commit_failures", s.commit_failures),
                            ("leasehold_ticks", s.tick_no),
                            ("leasehold_loop_turns", s.counters["turns"]),
                            ("leasehold_messages_received", s.counters["received"]),
                            ("leasehold_leases_pushed", s.counters["leases_pushed"]),
                            ("leasehold_leases_unsent", s.counters["leases_unsent"])):
            fam[name].add_metric([sh], float(value))
        for part in ("decide", "commit", "send"):
            fam["leasehold_loop_seconds"].add_metric([sh, part],
                                                     s.counters[f"{part}_ns"] / 1e9)
        for q in s.queues.values():
            labels = [sh, q.name]
            fam["leasehold_dispatches"].add_metric(labels, float(q.dispatched))
            # A (queue, reason) series appears with its first observation: every reason of
            # every queue from the start would multiply the scrape for mostly zeros.
            for reason, hist in q.wait_by_reason.items():
                fam["leasehold_queue_wait_seconds"].add_metric([*labels, reason],
                                                               _buckets(hist), hist.sum)
            fam["leasehold_queue_depth"].add_metric(labels, float(q.depth))
            fam["leasehold_queue_actions_in_flight"].add_metric(labels,
                                                                float(q.actions_in_flight))
            fam["leasehold_queue_runs_in_flight"].add_metric(labels, float(q.runs_in_flight))
            fam["leasehold_queue_backfilled"].add_metric(labels, float(q.backfilled))
            for res, v in q.in_flight_resources.items():
                fam["leasehold_queue_resources_in_flight"].add_metric([*labels, res], float(v))
            head = q.head_blocked
            if head is not None:
                fam["leasehold_queue_head_blocked"].add_metric([*labels, head.code], 1.0)
                fam["leasehold_queue_head_blocked_seconds"].add_metric(
                    [*labels, head.code], head.blocked_s + max(0, now - s.published_ns) / 1e9)
                if head.eta_s is not None:
                    fam["leasehold_queue_head_eta_seconds"].add_metric(
                        labels, max(0.0, head.eta_s - max(0, now - s.published_ns) / 1e9))
        for c in s.clusters.values():
            labels = [sh, c.name]
            for res in s.resources:
                rl = [*labels, res]
                fam["leasehold_cluster_capacity"].add_metric(rl, _value(c.capacity[res]))
                fam["leasehold_cluster_resources_in_flight"].add_metric(
                    rl, float(c.in_flight_resources[res]))
                fam["leasehold_cluster_free"].add_metric(rl, _value(c.free[res]))
            fam["leasehold_cluster_leases_in_flight"].add_metric(labels,
                                                                 float(c.leases_in_flight))
            fam["leasehold_cluster_workers_connected"].add_metric(labels,
                                                                  float(c.workers_connected))
            fam["leasehold_cluster_slots"].add_metric(labels, float(c.slots))
            fam["leasehold_cluster_dispatches"].add_metric(labels, float(c.dispatched))
        for name, counts in (("leasehold_heartbeat_refusals", s.heartbeat_refusals),
                             ("leasehold_report_refusals", s.report_refusals)):
            for verdict, n in counts.items():
                fam[name].add_metric([sh, verdict], float(n))
        for kind, n in s.errors.items():
            fam["leasehold_errors"].add_metric([sh, kind], float(n))

    def close(self):
        """Unmap every status file."""
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()


class MetricsServer:
    """The HTTP server :func:`serve_metrics` started: ``url``, ``host``, ``port`` (the bound
    one, also when 0 was asked), ``collector``, ``registry``; :meth:`close` stops it."""

    def __init__(self, httpd, thread, collector, registry):
        self._httpd, self._thread = httpd, thread
        self.collector, self.registry = collector, registry
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self):
        """``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout=5.0):
        """Stop serving, close the socket, join the thread, unmap the status files."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)
        self.collector.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_metrics(paths, host="127.0.0.1", port=9464):
    """Serve the Prometheus text format of the shards' status files at ``paths`` on
    ``http://host:port/metrics`` (any path answers; prometheus-client's server on a daemon
    thread) and return the :class:`MetricsServer`. Port 0 binds a free port. A port in use
    raises ``OSError`` naming the address."""
    collector = StatusCollector(paths)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        httpd, thread = start_http_server(int(port), addr=host, registry=registry)
    except OSError as exc:
        collector.close()
        raise OSError(exc.errno, f"metrics: cannot listen on {host}:{port}: "
                      f"{exc.strerror or exc}") from None
    return MetricsServer(httpd, thread, collector, registry)
