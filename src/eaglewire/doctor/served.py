"""The served acceptance figure, read from a running server's Prometheus ``/metrics`` page.

``eaglewire doctor --server URL`` turns what eaglewire's, vLLM's or SGLang's server exports into the
figures ``--observed-accept-len`` / ``--observed-accept-rate`` / ``--served-chain`` would give, so
acceptance.observed explains the number the server really reached. The names below are read from each
stack's released source (the version says which); a page with none of them is refused, naming them.

By default the doctor sends the server its own live prompts (greedy chat completions of ``--live-tokens``
tokens, one at a time) and reads the counters before and after: the figure then covers exactly the
continuations acceptance.observed predicts on, so the wiring the server really feeds the drafter predicts
it to within numerics. With ``server_traffic`` off it reads the totals as they stand, over whatever
traffic the server has had. Counters (eaglewire, vLLM) are totals since the server started. SGLang
exports gauges instead, over its last decode log interval (``--decode-log-interval`` batches), one per
scheduler rank; the ranks are averaged, and after the doctor's prompts they cover the last of them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from ..engine.drafting_labels import drafting_from_labels
from ..engine.speculative import GenerationConfig
from .state import LIVE_PROMPTS, DoctorConfig, DoctorError

FETCH_TIMEOUT_S = 10.0
COMPLETION_TIMEOUT_S = 600.0  # one greedy completion of --live-tokens on a busy CPU server


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
    drafting: str = ""  # info: how every request drafts (engine/drafting_labels.py)
    lookup_steps: str = ""  # counter: verify steps whose drafts were looked up in the context, not drafted

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.drafts, self.draft_tokens, self.accepted, self.accepted_at, self.accept_len,
                                 self.accept_rate, self.chain) if n)


STACK_METRICS = (
    StackMetrics("eaglewire", "eaglewire serve (src/eaglewire/serve/server.py)", drafts="eaglewire_drafts",
                 draft_tokens="eaglewire_draft_tokens", accepted="eaglewire_accepted_tokens",
                 accepted_at="eaglewire_accepted_tokens_per_position", first_position=1,
                 drafting="eaglewire_drafting_info", lookup_steps="eaglewire_lookup_steps"),
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
    prompts: int = 0  # the doctor's live prompts the figures cover (0: the server's own traffic)
    texts: tuple[str, ...] | None = None  # the server's answers to them
    # eaglewire's drafting as its server says it (engine/drafting_labels.py): the chain, where it stops, its lookups
    drafting: GenerationConfig | None = None
    lookup_steps: int | None = None  # verify steps that drafted from the context (not counted in ``drafts``)

    def describe(self) -> str:
        source = next(m.source for m in STACK_METRICS if m.stack == self.stack).split(" (")[0]
        looked_up = f" (and {self.lookup_steps} that drafted from the context)" if self.lookup_steps else ""
        counted = f", {self.drafts} verify steps{looked_up}" if self.drafts is not None else ", its last log interval"
        traffic = f" of the doctor's {self.prompts} live prompts" if self.prompts else " of the server's own traffic"
        return f"{source} metrics at {self.url}{counted}{traffic}"


def api_url(server: str, path: str) -> str:
    """``path`` on the server ``--server`` names (its scheme, host and port)."""
    parts = urllib.parse.urlsplit(metrics_url(server))
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


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


def _request_json(url: str, body: dict | None, timeout: float) -> dict:
    """GET (``body`` None) or POST JSON to ``url``; its JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        raise ServerMetricsError(f"{url} answered HTTP {exc.code} ({detail}): the doctor sends OpenAI chat "
                                 "completions; give the address of an OpenAI-compatible server, or "
                                 "--no-server-traffic to read its metrics only") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise ServerMetricsError(f"cannot reach {url} ({reason}): check that the server runs and the address and "
                                 "port are the ones it listens on") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ServerMetricsError(f"{url} did not answer JSON: is this an OpenAI-compatible server?") from exc


def served_model(server: str, timeout: float = FETCH_TIMEOUT_S) -> str:
    """The first model ``GET /v1/models`` lists: the name completions are asked for."""
    url = api_url(server, "/v1/models")
    models = _request_json(url, None, timeout).get("data") or []
    if not models or "id" not in models[0]:
        raise ServerMetricsError(f"{url} lists no model: is this an OpenAI-compatible server?")
    return models[0]["id"]


def send_live_prompts(server: str, prompts: Sequence[str], max_tokens: int,
                      timeout: float = COMPLETION_TIMEOUT_S) -> tuple[str, ...]:
    """Greedy chat completions of ``prompts``, one at a time, as the doctor's live continuations make them;
    the answers."""
    model, url = served_model(server), api_url(server, "/v1/chat/completions")
    answers = []
    for text in prompts:
        reply = _request_json(url, {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
                                    "max_tokens": max_tokens}, timeout)
        try:
            answers.append(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerMetricsError(f"{url} answered without choices[0].message.content: is this an "
                                     "OpenAI-compatible server?") from exc
    return tuple(answers)


def read_server(server: str, timeout: float = FETCH_TIMEOUT_S) -> ServedFigures:
    """The figures as the server's counters stand: over all its traffic since it started."""
    url, text = fetch_metrics(server, timeout)
    return parse_metrics(text, url)


def read_server_over(server: str, prompts: Sequence[str], max_tokens: int,
                     timeout: float = FETCH_TIMEOUT_S) -> ServedFigures:
    """The figures over the doctor's own ``prompts``: the counters after them less the counters before."""
    url, before = fetch_metrics(server, timeout)
    parse_metrics(before, url, need_drafts=False)  # refuse a page without speculative metrics before generating
    texts = send_live_prompts(server, prompts, max_tokens)
    _, after = fetch_metrics(server, timeout)
    figures = parse_metrics(after, url, before=_samples(before, url))
    return replace(figures, prompts=len(prompts), texts=texts)


Samples = dict[str, list[tuple[dict, float]]]


def _samples(text: str, url: str) -> Samples:
    try:
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    except ValueError as exc:
        raise ServerMetricsError(f"{url} is not a Prometheus text page ({exc}): give the server's /metrics URL") from exc
    return samples


def _counted_since(after: Samples, before: Samples) -> Samples:
    """Each counter (``*_total``) less its value in ``before`` for the same labels; gauges as they are now."""
    out: Samples = {}
    for name, rows in after.items():
        if not name.endswith("_total"):
            out[name] = rows
            continue
        earlier = {tuple(sorted(labels.items())): value for labels, value in before.get(name, [])}
        out[name] = [(labels, value - earlier.get(tuple(sorted(labels.items())), 0.0)) for labels, value in rows]
    return out


def parse_metrics(text: str, url: str, before: Samples | None = None, need_drafts: bool = True) -> ServedFigures | None:
    """The served figures from a Prometheus text page, by the first stack whose names it holds; counted since
    ``before`` (the page's samples at an earlier time) when given. ``need_drafts`` False only checks the page
    is one eaglewire reads (None then when nothing has been verified yet)."""
    samples = _samples(text, url)
    if before is not None:
        samples = _counted_since(samples, before)
    for metrics in STACK_METRICS:
        counters = metrics.drafts and f"{metrics.drafts}_total" in samples
        gauges = metrics.accept_len and (metrics.accept_len in samples or _registered(text, metrics.accept_len))
        if counters or gauges:
            try:
                return (_from_counters if counters else _from_gauges)(metrics, samples, url)
            except NoDrafts:
                if need_drafts:
                    raise
                return None
    looked_for = "; ".join(f"{m.source}: {', '.join(m.names)}" for m in STACK_METRICS)
    raise ServerMetricsError(f"{url} exports no speculative-decoding metrics eaglewire knows (looked for {looked_for}): "
                             "is speculative decoding on in this server? Otherwise give --observed-accept-len")


def _registered(text: str, name: str) -> bool:
    """A labelled gauge never set appears as its HELP/TYPE lines only."""
    return f"# TYPE {name} " in text


def _total(samples: dict, name: str) -> float:
    """A counter summed over its label sets (vLLM: one per engine)."""
    return sum(value for _, value in samples.get(f"{name}_total", []))


class NoDrafts(ServerMetricsError):
    """The page is one eaglewire reads, but it counts no verified draft."""


def _no_drafts(metrics: StackMetrics, url: str) -> NoDrafts:
    return NoDrafts(f"{url} ({metrics.source}) has verified no drafts yet over the traffic read: send it "
                    "requests, or let the doctor send its prompts (drop --no-server-traffic), then run the doctor "
                    "again. A server without a drafter, or one that drafts only for a request running alone while "
                    "others run, counts none")


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
    drafting = _drafting(metrics, samples, url)
    # eaglewire says its chain; vLLM labels its whole chain (num_speculative_tokens); otherwise the draft
    # tokens per step say it
    if drafting is not None:
        chain = drafting.chain_length
    elif metrics.every_position and by_position:
        chain = len(by_position)
    else:
        chain = max(len(by_position), round(draft_tokens / drafts))
    per_position = tuple(by_position.get(d, 0.0) / drafts for d in range(1, chain + 1)) if by_position else None
    lookup_steps = int(_total(samples, metrics.lookup_steps)) if metrics.lookup_steps else None
    return ServedFigures(metrics.stack, url, 1 + accepted / drafts, accepted / draft_tokens, chain, per_position,
                         int(drafts), drafting=drafting, lookup_steps=lookup_steps)


def _drafting(metrics: StackMetrics, samples: Samples, url: str) -> GenerationConfig | None:
    """An eaglewire server's drafting from its ``eaglewire_drafting_info`` (None: the stack exports none)."""
    rows = samples.get(metrics.drafting, []) if metrics.drafting else []
    if not rows:
        return None
    labels = rows[0][0]
    try:  # an EaglewireError (a value out of range) is a ValueError too
        drafting = drafting_from_labels(labels)
    except (KeyError, ValueError) as exc:
        raise ServerMetricsError(f"{url}: {metrics.drafting} has labels {labels}, not the strategy, chain_length, "
                                 f"min_confidence and lookup_* that {metrics.source} exports ({exc})") from exc
    if drafting.strategy != "chain":
        raise ServerMetricsError(f"{url} ({metrics.source}) drafts with --strategy {drafting.strategy}; "
                                 "acceptance.observed walks a greedy chain: serve with --strategy chain to check the "
                                 "wiring it feeds the drafter")
    return drafting


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
    (the server's chain wins: it is the one that ran), over the doctor's live prompts unless
    ``cfg.server_traffic`` is off. Read once: a config already holding them is returned."""
    if cfg.server is None or cfg.served_from is not None:
        return cfg
    if cfg.observed_accept_len is not None or cfg.observed_accept_rate is not None:
        raise ServerMetricsError("--server reads the observed figure from the server; drop --observed-accept-len and "
                                 "--observed-accept-rate, or drop --server")
    if cfg.server_traffic:
        figures = read_server_over(cfg.server, LIVE_PROMPTS[:cfg.live_prompts], cfg.live_tokens)
    else:
        figures = read_server(cfg.server)
    min_confidence, lookup = ((figures.drafting.min_confidence, figures.drafting.lookup) if figures.drafting
                              else (cfg.served_min_confidence, cfg.served_lookup))
    return replace(cfg, observed_accept_len=figures.accept_len, observed_accept_rate=figures.accept_rate,
                   served_chain=figures.chain if figures.chain is not None else cfg.served_chain,
                   observed_per_position=figures.per_position, served_from=figures.describe(),
                   served_texts=figures.texts, served_min_confidence=min_confidence,
                   served_lookup=lookup, served_lookup_steps=figures.lookup_steps)
