"""The served acceptance figure, read from a running server's Prometheus ``/metrics`` page.

``eaglewire doctor --server URL`` turns what eaglewire's, vLLM's or SGLang's server exports into the
figures ``--observed-accept-len`` / ``--observed-accept-rate`` / ``--served-chain`` would give, so
acceptance.observed explains the number the server really reached. The names below are read from each
stack's released source (the version says which); a page with none of them is refused, naming them.

Counters (eaglewire, vLLM) are totals since the server started: the figure is over every verify step so
far. SGLang exports gauges instead, over its last decode log interval (``--decode-log-interval``
batches), one per scheduler rank; the ranks are averaged.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from .state import DoctorConfig, DoctorError

FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class StackMetrics:
    """The names one stack's server exports for speculative decoding (counters without ``_total``)."""

    stack: str
    source: str  # where the names come from, for the report and the README
    drafts: str = ""  # counter: verify steps that checked drafts
    draft_tokens: str = ""  # counter: draft tokens sent to verification
    accepted: str = ""  # counter: draft tokens accepted
    accepted_at: str = ""  # counter labelled by position: accepted tokens at each draft depth
    first_position: int = 0  # the label of the first draft position (vLLM counts from 0, eaglewire from 1)
    # vLLM registers a position label for every draft depth up front; eaglewire's labels appear only once a
    # token is accepted at that depth, so they may stop short of its chain
    every_position: bool = False
    accept_len: str = ""  # gauge: accepted drafts + bonus per verify step
    accept_rate: str = ""  # gauge: accepted / drafted tokens
    chain: str = ""  # gauge: draft steps per verify step

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.drafts, self.draft_tokens, self.accepted, self.accepted_at, self.accept_len,
                                 self.accept_rate, self.chain) if n)


STACK_METRICS = (
    StackMetrics("eaglewire", "eaglewire serve (src/eaglewire/serve/server.py)", drafts="eaglewire_drafts",
                 draft_tokens="eaglewire_draft_tokens", accepted="eaglewire_accepted_tokens",
                 accepted_at="eaglewire_accepted_tokens_per_position", first_position=1),
    StackMetrics("vllm", "vLLM 0.33.0 (vllm/v1/spec_decode/metrics.py)", drafts="vllm:spec_decode_num_drafts",
                 draft_tokens="vllm:spec_decode_num_draft_tokens", accepted="vllm:spec_decode_num_accepted_tokens",
                 accepted_at="vllm:spec_decode_num_accepted_tokens_per_pos", first_position=0, every_position=True),
    StackMetrics("sglang", "SGLang 0.5.23 (sglang/srt/observability/metrics_collector.py)",
                 accept_len="sglang:spec_accept_length", accept_rate="sglang:spec_accept_rate",
                 chain="sglang:spec_num_steps"),
)


class ServerMetricsError(DoctorError):
    """The server's metrics could not be read, or hold no served acceptance figure."""


@dataclass(frozen=True)
class ServedFigures:
    """What the server reached: the figures acceptance.observed explains, and where they come from."""

    stack: str
    url: str
    accept_len: float  # tokens per verify step, bonus included
    accept_rate: float | None  # accepted / drafted tokens
    chain: int | None  # draft tokens per verify step, when the server says
    per_position: tuple[float, ...] | None  # share of verify steps accepting the draft at depth 1, 2, ...
    drafts: int | None  # verify steps counted (counters only)

    def describe(self) -> str:
        source = next(m.source for m in STACK_METRICS if m.stack == self.stack).split(" (")[0]
        counted = f", {self.drafts} verify steps" if self.drafts is not None else ", its last log interval"
        return f"{source} metrics at {self.url}{counted}"


def metrics_url(server: str) -> str:
    """``http://host:port`` (its ``/metrics`` page) or the page's full URL."""
    parts = urllib.parse.urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ServerMetricsError(f"--server {server!r} is not an http(s) URL: give the server's address, e.g. "
                                 "http://localhost:8000 (its /metrics page is read)")
    if parts.path in ("", "/"):
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/metrics", parts.query, ""))
    return server


def fetch_metrics(server: str, timeout: float = FETCH_TIMEOUT_S) -> tuple[str, str]:
    """(the metrics page's URL, its text)."""
    url = metrics_url(server)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return url, response.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        raise ServerMetricsError(f"{url} answered HTTP {exc.code}: give the address of a server that exports "
                                 "Prometheus metrics (SGLang needs --enable-metrics)") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise ServerMetricsError(f"cannot reach {url} ({reason}): check that the server runs and the address and "
                                 "port are the ones it listens on, or give --observed-accept-len instead") from exc
    except UnicodeDecodeError as exc:
        raise ServerMetricsError(f"{url} is not a text page: give the server's Prometheus /metrics URL") from exc


def read_server(server: str, timeout: float = FETCH_TIMEOUT_S) -> ServedFigures:
    url, text = fetch_metrics(server, timeout)
    return parse_metrics(text, url)


def parse_metrics(text: str, url: str) -> ServedFigures:
    """The served figures from a Prometheus text page, by the first stack whose names it holds."""
    try:
        samples: dict[str, list[tuple[dict, float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    except ValueError as exc:
        raise ServerMetricsError(f"{url} is not a Prometheus text page ({exc}): give the server's /metrics URL") from exc
    for metrics in STACK_METRICS:
        counters = metrics.drafts and f"{metrics.drafts}_total" in samples
        gauges = metrics.accept_len and (metrics.accept_len in samples or _registered(text, metrics.accept_len))
        if counters:
            return _from_counters(metrics, samples, url)
        if gauges:
            return _from_gauges(metrics, samples, url)
    looked_for = "; ".join(f"{m.source}: {', '.join(m.names)}" for m in STACK_METRICS)
    raise ServerMetricsError(f"{url} exports no speculative-decoding metrics eaglewire knows (looked for {looked_for}): "
                             "is speculative decoding on in this server? Otherwise give --observed-accept-len")


def _registered(text: str, name: str) -> bool:
    """A labelled gauge never set appears as its HELP/TYPE lines only."""
    return f"# TYPE {name} " in text


def _total(samples: dict, name: str) -> float:
    """A counter summed over its label sets (vLLM: one per engine)."""
    return sum(value for _, value in samples.get(f"{name}_total", []))


def _no_drafts(metrics: StackMetrics, url: str) -> ServerMetricsError:
    return ServerMetricsError(f"{url} ({metrics.source}) has verified no drafts yet: send it some requests (e.g. "
                              "`eaglewire bench` against it, or your own traffic), then run the doctor again")


def _from_counters(metrics: StackMetrics, samples: dict, url: str) -> ServedFigures:
    drafts, draft_tokens, accepted = (_total(samples, n) for n in (metrics.drafts, metrics.draft_tokens, metrics.accepted))
    if drafts <= 0 or draft_tokens <= 0:
        raise _no_drafts(metrics, url)
    by_position: dict[int, float] = {}
    for labels, value in samples.get(f"{metrics.accepted_at}_total", []):
        try:
            depth = int(labels["position"]) - metrics.first_position + 1
        except (KeyError, ValueError) as exc:
            raise ServerMetricsError(f"{url}: {metrics.accepted_at} has a sample without an integer 'position' label "
                                     f"({labels}); this is not {metrics.source}'s exposition") from exc
        by_position[depth] = by_position.get(depth, 0.0) + value
    if sorted(by_position) != list(range(1, len(by_position) + 1)):
        raise ServerMetricsError(f"{url}: {metrics.accepted_at} has positions {sorted(by_position)}, not "
                                 "consecutive from the first draft; this is not the exposition eaglewire reads")
    # vLLM labels its whole chain (num_speculative_tokens); otherwise the draft tokens per step say it
    chain = (len(by_position) if metrics.every_position and by_position
             else max(len(by_position), round(draft_tokens / drafts)))
    per_position = tuple(by_position.get(d, 0.0) / drafts for d in range(1, chain + 1)) if by_position else None
    return ServedFigures(metrics.stack, url, 1 + accepted / drafts, accepted / draft_tokens, chain, per_position,
                         int(drafts))


def _gauge(samples: dict, name: str) -> float | None:
    """A gauge averaged over the ranks that set it (SGLang: one per scheduler rank)."""
    values = [value for _, value in samples.get(name, [])]
    return sum(values) / len(values) if values else None


def _from_gauges(metrics: StackMetrics, samples: dict, url: str) -> ServedFigures:
    steps = _gauge(samples, metrics.chain)
    if steps is not None and steps == 0:
        raise ServerMetricsError(f"{url} ({metrics.source}) runs without speculative decoding ({metrics.chain} is 0): "
                                 "start it with a drafter (--speculative-algorithm EAGLE3) and send it requests")
    accept_len = _gauge(samples, metrics.accept_len)
    if accept_len is None or accept_len < 1:  # unset, or 0 until a decode batch has been logged
        raise _no_drafts(metrics, url)
    rate = _gauge(samples, metrics.accept_rate)
    return ServedFigures(metrics.stack, url, accept_len, rate, round(steps) if steps is not None else None, None, None)


def with_served_figures(cfg: DoctorConfig) -> DoctorConfig:
    """``cfg`` with the figures of ``cfg.server`` in place of --observed-accept-len / -rate and --served-chain
    (the server's chain wins: it is the one that ran). Read once: a config already holding them is returned."""
    if cfg.server is None or cfg.served_from is not None:
        return cfg
    if cfg.observed_accept_len is not None or cfg.observed_accept_rate is not None:
        raise ServerMetricsError("--server reads the observed figure from the server; drop --observed-accept-len and "
                                 "--observed-accept-rate, or drop --server")
    figures = read_server(cfg.server)
    return replace(cfg, observed_accept_len=figures.accept_len, observed_accept_rate=figures.accept_rate,
                   served_chain=figures.chain if figures.chain is not None else cfg.served_chain,
                   observed_per_position=figures.per_position, served_from=figures.describe())
