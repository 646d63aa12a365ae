"""eaglewire doctor --server: the served acceptance figure read from a running server's /metrics.

Each fake server serves a fixed page shaped like its stack's real exposition (names and labels from the
released source: eaglewire's serve/server.py, vLLM 0.33.0's v1/spec_decode/metrics.py, SGLang 0.5.23's
observability/metrics_collector.py) from a local http.server thread.
"""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager

import pytest
import torch

from eaglewire.doctor.checks import DoctorConfig, run_doctor
from eaglewire.doctor.evidence import chain_hits, served_steps
from eaglewire.doctor.served import ServerMetricsError, read_server, with_served_figures
from eaglewire.doctor.state import LIVE_PROMPTS, LiveSample
from eaglewire.drafter.checkpoint import (
    CheckpointMeta,
    load_checkpoint,
    save_checkpoint,
)
from eaglewire.drafter.model import Drafter, DrafterConfig
from eaglewire.engine.context_lookup import LookupShape
from eaglewire.engine.drafting_labels import drafting_from_labels, drafting_labels
from eaglewire.engine.speculative import GenerationConfig
from eaglewire.target import load_target
from eaglewire.train.ttt import unroll_fused
from eaglewire.wiring import Wiring

EAGLEWIRE_PAGE = """\
# HELP eaglewire_drafts_total Verify steps that checked draft tokens
# TYPE eaglewire_drafts_total counter
eaglewire_drafts_total 200.0
# HELP eaglewire_drafts_created Verify steps that checked draft tokens
# TYPE eaglewire_drafts_created gauge
eaglewire_drafts_created 1.7e+09
# HELP eaglewire_draft_tokens_total Draft tokens sent to verification
# TYPE eaglewire_draft_tokens_total counter
eaglewire_draft_tokens_total 600.0
# HELP eaglewire_accepted_tokens_total Draft tokens accepted
# TYPE eaglewire_accepted_tokens_total counter
eaglewire_accepted_tokens_total 150.0
# HELP eaglewire_accepted_tokens_per_position_total Draft tokens accepted at each depth
# TYPE eaglewire_accepted_tokens_per_position_total counter
eaglewire_accepted_tokens_per_position_total{position="1"} 90.0
eaglewire_accepted_tokens_per_position_total{position="2"} 40.0
eaglewire_accepted_tokens_per_position_total{position="3"} 20.0
# HELP eaglewire_generated_tokens_total Tokens returned to clients
# TYPE eaglewire_generated_tokens_total counter
eaglewire_generated_tokens_total 350.0
"""

# two engines (data parallel): the counters add up; positions count from 0; chain of 4
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="llama"} 300.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="llama"} 100.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="llama"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama"} 1200.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="llama"} 400.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama"} 450.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="llama"} 150.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="0"} 200.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="1"} 130.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="2"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="3"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="llama",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="llama",position="1"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="llama",position="2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="llama",position="3"} 10.0
"""

SGLANG_LABELS = 'engine_type="unified",model_name="llama",moe_ep_rank="0",pp_rank="0",tp_rank="{rank}"'
SGLANG_PAGE = "".join(
    f"# HELP {name} {doc}\n# TYPE {name} gauge\n"
    + "".join(f"{name}{{{SGLANG_LABELS.format(rank=rank)}}} {value}\n" for rank, value in enumerate(values))
    for name, doc, values in (
        ("sglang:num_running_reqs", "The number of running requests.", (2.0, 2.0)),
        ("sglang:spec_accept_length", "Mean acceptance length of speculative decoding.", (2.1, 2.3)),
        ("sglang:spec_accept_rate", "Speculative acceptance rate.", (0.36, 0.44)),
        ("sglang:spec_num_steps", "Currently active speculative_num_steps.", (3.0, 3.0)),
        ("sglang:spec_num_draft_tokens", "Currently active speculative_num_draft_tokens.", (4.0, 4.0)),
    ))


@contextmanager
def serving(page: str, status: int = 200):
    """A local server answering every GET with ``page``; yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = page.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class CountingServer:
    """A fake OpenAI-compatible server whose vLLM counters grow by fixed amounts with each chat completion:
    every request adds 10 verify steps, 40 draft tokens and 15 accepted ones (depths 9/4/2/0)."""

    def __init__(self, before: int = 30):
        self.requests: list[dict] = []
        self.before = before  # completions counted before the doctor's

    def page(self) -> str:
        n = self.before + len(self.requests)
        rows = [("drafts", "", 10 * n), ("draft_tokens", "", 40 * n), ("accepted_tokens", "", 15 * n)]
        rows += [("accepted_tokens_per_pos", f',position="{k}"', c * n) for k, c in enumerate((9, 4, 2, 0))]
        text = ""
        for name, label, value in rows:
            text += f"# TYPE vllm:spec_decode_num_{name} counter\n"
            text += f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="m"{label}}} {float(value)}\n'
        return text

    @contextmanager
    def running(self):
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.answer(json.dumps({"object": "list", "data": [{"id": "served-model", "object": "model"}]}))
                else:
                    self.answer(fake.page(), "text/plain; version=0.0.4")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, **body})
                self.answer(json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]}))

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


def test_the_doctor_sends_its_live_prompts_and_reads_the_counters_over_them():
    """The figures cover the doctor's requests only: 30 earlier completions with the same per-request
    counts would give the same rates, so the check is on the step count and the requests themselves."""
    fake = CountingServer(before=30)
    with fake.running() as url:
        cfg = with_served_figures(DoctorConfig(checkpoint="x", server=url, live_prompts=3, live_tokens=20))
    assert [r["messages"] for r in fake.requests] == [[{"role": "user", "content": t}] for t in LIVE_PROMPTS[:3]]
    assert all(r["path"] == "/v1/chat/completions" and r["model"] == "served-model" and r["temperature"] == 0
               and r["max_tokens"] == 20 for r in fake.requests)
    assert cfg.observed_accept_len == pytest.approx(2.5) and cfg.observed_accept_rate == pytest.approx(15 / 40)
    assert cfg.served_chain == 4 and cfg.observed_per_position == pytest.approx((0.9, 0.4, 0.2, 0.0))
    assert "30 verify steps of the doctor's 3 live prompts" in cfg.served_from
    quiet = CountingServer(before=30)
    with quiet.running() as url:
        passive = with_served_figures(DoctorConfig(checkpoint="x", server=url, server_traffic=False))
    assert quiet.requests == [] and "300 verify steps of the server's own traffic" in passive.served_from


def test_a_server_that_drafts_nothing_for_the_doctors_prompts_is_refused():
    fake = CountingServer(before=5)
    fake.page = lambda: CountingServer(before=5).page()  # counters that never move
    with fake.running() as url, pytest.raises(ServerMetricsError, match="verified no drafts yet over the traffic"):
        with_served_figures(DoctorConfig(checkpoint="x", server=url, live_prompts=1, live_tokens=8))
    assert len(fake.requests) == 1


def test_served_steps_walk_the_rows_a_server_verifies_at():
    """Row r (hidden state r, token r+1) drafts tokens r+2 on. The first chain follows the prefill's token
    (row prompt_len - 1); a step that accepts a drafts moves a + 1 rows on; near max_new_tokens the chain
    shortens to the tokens still allowed beyond the bonus, and a step with none is not counted."""
    hits = torch.zeros(20, 3, dtype=torch.bool)
    for row, accepted in {4: 2, 7: 0, 8: 3, 12: 1, 14: 1, 16: 3, 17: 3}.items():
        hits[row, :accepted] = True
    hits[7, 1:] = True  # accepted drafts stop at the first miss
    ids = torch.arange(100, 119)  # a prompt of 5, then 14 generated tokens (indices 5..18), nothing repeated
    # max_new_tokens 14: rows 4, 7, 8, 12, 14 (whose chain is cut to 2), then row 16 may draft
    # 14 - 13 - 1 = 0 tokens (a plain step) and row 17 is the end
    steps, looked_up = served_steps(hits, ids, prompt_len=5, max_new_tokens=14)
    assert steps.tolist() == [2, 0, 3, 1, 1] and looked_up == 0
    # the same 14 tokens ended by EOS under a larger budget: row 16 drafts its full chain
    assert served_steps(hits, ids, prompt_len=5, max_new_tokens=100)[0].tolist() == [2, 0, 3, 1, 1, 3]
    assert served_steps(hits, ids[:6], prompt_len=5, max_new_tokens=1)[0].numel() == 0


def test_served_steps_skip_the_steps_that_draft_from_the_context():
    """With lookups, a step whose context's last tokens occurred before drafts what followed them, as
    engine/context_lookup.py finds it; it moves the walk on by its own accepted drafts, and the drafter's
    counters (hence the returned steps) skip it."""
    prompt, answer = [10, 11, 12, 13], [20, 10, 11, 12, 13, 20, 10, 30, 31, 32]
    ids = torch.tensor(prompt + answer)
    hits = torch.zeros(13, 3, dtype=torch.bool)
    hits[3, :1] = True
    hits[5, :] = hits[9, :] = True  # never read: those steps look up
    hits[10, :2] = True
    lookup = LookupShape(min_match=2, max_drafts=3)
    # row 3: [13, 20] is new, the drafter accepts 1; row 5: [10, 11] occurred at 0, followed by 12 13 20, all
    # kept; row 9: ...20 10 matches from the start, followed by 11 12 13, not 30 31 32: none kept; row 10: the
    # drafter again, 2 kept, and row 13 ends the answer
    steps, looked_up = served_steps(hits, ids, prompt_len=4, max_new_tokens=100, lookup=lookup)
    assert steps.tolist() == [1, 2] and looked_up == 2
    steps, looked_up = served_steps(hits, ids, prompt_len=4, max_new_tokens=100)
    assert steps.tolist() == [1, 3, 3] and looked_up == 0


def test_chain_hits_end_the_chain_after_a_doubted_draft(random_checkpoint):
    """As the engine's chain does, a draft the drafter gives less than min_confidence is the chain's last:
    the drafts after it are misses, whatever they would have been."""
    folder, target = random_checkpoint
    drafter = load_checkpoint(folder, target.layout.embed).drafter.float()
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (24,))
    fused = torch.randn(23, drafter.config.hidden_size)
    with torch.no_grad():
        steps = unroll_fused(drafter, ids, fused, 3)
    confidence = [step.softmax(-1).max(-1).values for step in steps]
    # the target "agrees" with drafts 1 and 2 from every even row, so those chains hit twice unless cut
    top1, even = ids.clone(), torch.arange(0, 22, 2)
    top1[even + 1] = drafter.draft_to_target(steps[0].argmax(-1))[even]
    top1[even + 2] = drafter.draft_to_target(steps[1].argmax(-1))[even]
    sample = LiveSample(ids, 4, {}, top1)
    free = chain_hits(drafter, fused, sample, 3)
    assert free[even, :2].all()
    threshold = float(confidence[0][even].median())
    cut = chain_hits(drafter, fused, sample, 3, min_confidence=threshold)
    made = torch.stack([torch.ones(23, dtype=torch.bool), confidence[0] >= threshold,
                        (confidence[0] >= threshold) & (confidence[1] >= threshold)], dim=1)
    assert torch.equal(cut, free & made)
    assert cut[even, 0].all() and 0 < int(cut[even, 1].sum()) < len(even)  # the threshold cut some chains short
    assert torch.equal(chain_hits(drafter, fused, sample, 3, min_confidence=1.0), free & made[:, :1].expand(23, 3)
                       & torch.tensor([True, False, False]))


def test_eaglewire_counters():
    with serving(EAGLEWIRE_PAGE) as url:
        figures = read_server(url)
    assert figures.stack == "eaglewire" and figures.url == url + "/metrics"
    assert figures.accept_len == pytest.approx(1.75) and figures.accept_rate == pytest.approx(0.25)
    assert figures.chain == 3 and figures.drafts == 200
    assert figures.per_position == pytest.approx((0.45, 0.2, 0.1))


def test_eaglewire_positions_never_accepted_are_not_labelled():
    """eaglewire's server adds a depth's label once a token is accepted there: the chain comes from the
    draft tokens per step, and the missing depths accepted nothing."""
    page = EAGLEWIRE_PAGE.replace('eaglewire_accepted_tokens_per_position_total{position="3"} 20.0\n', "")
    with serving(page) as url:
        figures = read_server(url)
    assert figures.chain == 3 and figures.per_position == pytest.approx((0.45, 0.2, 0.0))
    nothing = "".join(line + "\n" for line in EAGLEWIRE_PAGE.splitlines() if "{position=" not in line)
    with serving(nothing.replace("_total 150.0", "_total 0.0")) as url:
        figures = read_server(url)
    assert figures.chain == 3 and figures.per_position is None and figures.accept_len == 1.0


def test_vllm_counters_summed_over_engines():
    with serving(VLLM_PAGE) as url:
        figures = read_server(url + "/metrics")
    assert figures.stack == "vllm" and figures.drafts == 400 and figures.chain == 4
    assert figures.accept_len == pytest.approx(2.5) and figures.accept_rate == pytest.approx(600 / 1600)
    assert figures.per_position == pytest.approx((0.7, 0.425, 0.25, 0.125))
    assert "vLLM 0.33.0 metrics at" in figures.describe()


def test_sglang_gauges_averaged_over_ranks():
    with serving(SGLANG_PAGE) as url:
        figures = read_server(url)
    assert figures.stack == "sglang" and figures.chain == 3 and figures.drafts is None
    assert figures.accept_len == pytest.approx(2.2) and figures.accept_rate == pytest.approx(0.4)
    assert figures.per_position is None


def test_unreachable_server():
    with serving("") as url:  # a port that was just free: nothing listens there once the server is gone
        pass
    with pytest.raises(ServerMetricsError, match="cannot reach .* check that the server runs"):
        read_server(url, timeout=2)
    with pytest.raises(ServerMetricsError, match="not an http"):
        read_server("localhost:8000")


def test_page_without_spec_decode_metrics_names_what_was_looked_for():
    page = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    with serving(page) as url, pytest.raises(ServerMetricsError) as info:
        read_server(url)
    text = str(info.value)
    assert "vLLM 0.33.0" in text and "vllm:spec_decode_num_drafts" in text
    assert "SGLang 0.5.23" in text and "sglang:spec_accept_length" in text
    assert "eaglewire serve" in text and "eaglewire_accepted_tokens" in text
    with serving("<html>not metrics</html>") as url, pytest.raises(ServerMetricsError, match="not a Prometheus"):
        read_server(url)
    with serving("gone", status=404) as url, pytest.raises(ServerMetricsError, match="HTTP 404"):
        read_server(url)


def test_zero_drafts_so_far():
    zero = VLLM_PAGE.replace("300.0", "0.0").replace("100.0", "0.0")
    with serving(zero) as url, pytest.raises(ServerMetricsError, match="verified no drafts yet"):
        read_server(url)
    # SGLang before its first decode log: the labelled gauges are registered but never set
    unset = "".join(line + "\n" for line in SGLANG_PAGE.splitlines()
                    if line.startswith("#") or not line.startswith("sglang:spec_accept"))
    with serving(unset) as url, pytest.raises(ServerMetricsError, match="verified no drafts yet"):
        read_server(url)
    off = SGLANG_PAGE.replace("} 3.0", "} 0.0")
    with serving(off) as url, pytest.raises(ServerMetricsError, match="without speculative decoding"):
        read_server(url)


def test_server_and_observed_flags_exclude_each_other():
    cfg = DoctorConfig(checkpoint="x", server="http://127.0.0.1:9", observed_accept_len=2.0)
    with pytest.raises(ServerMetricsError, match="drop --observed-accept-len"):
        with_served_figures(cfg)


# ---- the doctor receives the figures as the flags would give them -------------------------------


def random_drafter(target, folder, wiring: str = "layer1.out,layer2.out,layer4.out"):
    """A random drafter on ``target`` saved at ``folder``: the checks read its wiring and run it, whatever it learnt."""
    c = target.model.config
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                           head_dim=c.hidden_size // c.num_attention_heads, vocab_size=c.vocab_size,
                           draft_vocab_size=256, num_aux=len(wiring.split(",")))
    drafter = Drafter(config, target.layout.embed, torch.arange(256))
    return save_checkpoint(folder, drafter, CheckpointMeta(wiring=Wiring.parse(wiring), target=target.fingerprint))


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory, tiny_target_dir):
    """acceptance.observed needs a drafter, not a good one."""
    target = load_target(str(tiny_target_dir("llama")))
    return random_drafter(target, tmp_path_factory.mktemp("served") / "checkpoint"), target


def test_the_observed_check_receives_the_served_figures(random_checkpoint):
    folder, target = random_checkpoint
    options = {"checkpoint": str(folder), "engine": "vllm", "live_prompts": 1, "live_tokens": 16}
    with serving(VLLM_PAGE) as url:
        served = run_doctor(DoctorConfig(server=url, server_traffic=False, **options),
                            target=target).result("acceptance.observed")
    typed = run_doctor(DoctorConfig(observed_accept_len=2.5, observed_accept_rate=600 / 1600, served_chain=4, **options),
                       target=target).result("acceptance.observed")
    assert served.data["observed_accept_len"] == pytest.approx(2.5) and served.data["chain"] == 4
    assert served.data["rows"] == typed.data["rows"]
    assert served.status == typed.status
    assert served.data["observed_per_position"] == pytest.approx((0.7, 0.425, 0.25, 0.125))
    assert "= 2.500 (vLLM 0.33.0 metrics at " in served.detail
    assert "400 verify steps of the server's own traffic" in served.detail
    assert "per draft position served 0.70/0.42/0.25/0.12" in served.detail


def test_pages_written_by_prometheus_client_as_each_server_registers_its_metrics():
    """The fixtures' shape checked against the real exposition: eaglewire's own ServerMetrics, and
    counters/gauges registered with the names and labels vLLM's and SGLang's source gives them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from eaglewire.doctor.served import parse_metrics
    from eaglewire.serve.server import ServerMetrics

    registry = CollectorRegistry()
    ours = ServerMetrics(registry, GenerationConfig(chain_length=3, min_confidence=0.0))
    ours.drafts.inc(10)
    ours.draft_tokens.inc(30)
    ours.accepted.inc(12)
    for position, count in enumerate((7, 4, 1), start=1):
        ours.accepted_at.labels(position=str(position)).inc(count)
    figures = parse_metrics(generate_latest(registry).decode(), "eaglewire")
    assert (figures.stack, figures.chain, figures.accept_len) == ("eaglewire", 3, pytest.approx(2.2))
    assert figures.per_position == pytest.approx((0.7, 0.4, 0.1))
    assert (figures.drafting, figures.lookup_steps) == (GenerationConfig(chain_length=3, min_confidence=0.0), 0)

    # the chain as the server runs it: its length (not the drafts per step), where it stops, and its lookups
    registry = CollectorRegistry()
    lookup = LookupShape(min_match=3, max_drafts=4)
    ours = ServerMetrics(registry, GenerationConfig(chain_length=6, min_confidence=0.4, lookup=lookup))
    ours.drafts.inc(10)
    ours.draft_tokens.inc(20)
    ours.accepted.inc(9)
    ours.accepted_at.labels(position="1").inc(9)
    ours.lookup_steps.inc(5)
    figures = parse_metrics(generate_latest(registry).decode(), "eaglewire")
    assert (figures.chain, figures.drafting, figures.lookup_steps) == (
        6, GenerationConfig(chain_length=6, min_confidence=0.4, lookup=lookup), 5)
    assert figures.per_position == pytest.approx((0.9, 0, 0, 0, 0, 0))
    assert "10 verify steps (and 5 that drafted from the context)" in figures.describe()

    registry = CollectorRegistry()
    ours = ServerMetrics(registry, GenerationConfig(strategy="tree"))
    ours.drafts.inc(1)
    ours.draft_tokens.inc(5)
    with pytest.raises(ServerMetricsError, match="drafts with --strategy tree; acceptance.observed walks a greedy chain"):
        parse_metrics(generate_latest(registry).decode(), "eaglewire")
    broken = generate_latest(registry).decode().replace('strategy="tree"', 'shape="tree"')
    with pytest.raises(ServerMetricsError, match="eaglewire_drafting_info has labels"):
        parse_metrics(broken, "eaglewire")
    out_of_range = generate_latest(registry).decode().replace('strategy="tree"', 'strategy="chain"').replace(
        'min_confidence="0.5"', 'min_confidence="1.5"')
    with pytest.raises(ServerMetricsError, match="has labels .*min_confidence must be in"):
        parse_metrics(out_of_range, "eaglewire")

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    for name, value in (("drafts", 4), ("draft_tokens", 8), ("accepted_tokens", 3)):
        Counter(f"vllm:spec_decode_num_{name}", "doc", labels, registry=registry).labels("m", "0").inc(value)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "doc", [*labels, "position"], registry=registry)
    for position, count in enumerate((2, 1)):
        per_pos.labels("m", "0", str(position)).inc(count)
    figures = parse_metrics(generate_latest(registry).decode(), "vllm")
    assert (figures.stack, figures.chain, figures.accept_len, figures.per_position) == (
        "vllm", 2, pytest.approx(1.75), pytest.approx((0.5, 0.25)))

    registry = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
    for name, value in (("spec_accept_length", 1.8), ("spec_accept_rate", 0.2), ("spec_num_steps", 4)):
        Gauge(f"sglang:{name}", "doc", labels, registry=registry).labels("m", "unified", "0", "0", "0").set(value)
    figures = parse_metrics(generate_latest(registry).decode(), "sglang")
    assert (figures.stack, figures.chain, figures.accept_len, figures.accept_rate) == (
        "sglang", 4, pytest.approx(1.8), pytest.approx(0.2))


@pytest.mark.parametrize("drafting", [
    GenerationConfig(),
    GenerationConfig(strategy="tree", chain_length=1, min_confidence=0.0),
    GenerationConfig(chain_length=9, min_confidence=0.1 + 0.2, lookup=LookupShape(min_match=2, max_drafts=7,
                                                                                    longest_match=11)),
])
def test_drafting_labels_read_back_as_the_servers_drafting(drafting):
    # every value a label, and read back exactly (min_confidence's repr keeps the float's every bit)
    labels = drafting_labels(drafting)
    assert all(isinstance(value, str) for value in labels.values())
    back = drafting_from_labels(labels)
    assert (back.strategy, back.chain_length, back.min_confidence, back.lookup) == (
        drafting.strategy, drafting.chain_length, drafting.min_confidence, drafting.lookup)
