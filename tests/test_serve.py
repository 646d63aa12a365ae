"""A real `eaglewire serve` process on loopback, talked to with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest
import torch

from eaglewire.doctor.checks import DoctorConfig, run_doctor
from eaglewire.doctor.state import FAIL, PASS
from eaglewire.drafter.checkpoint import load_checkpoint, save_checkpoint
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.engine.generation_metrics import GenerationMetrics
from eaglewire.engine.lean import SequenceCall
from eaglewire.engine.speculative import Chunk, Engine, Finished, GenerationConfig
from eaglewire.serve.launch import launch
from eaglewire.serve.scheduler import Job, QueueFull, Scheduler, ShuttingDown, Started
from eaglewire.wiring import Wiring

MAX_LEN = 512
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    server = launch(["--max-len", str(MAX_LEN), "--log-interval", "1"], keep_output=True)
    yield server.url
    log = server.stop(30)
    assert "tau" in log and "tok/s" in log  # the periodic status line


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(smollm2):
    checkpoint = load_checkpoint(shipped_drafter(MODEL), smollm2.layout.embed)
    return Engine(smollm2, checkpoint.drafter.float(), checkpoint.meta.wiring, max_len=MAX_LEN)


def reference(engine, ids, max_tokens) -> Finished:
    return engine.complete_ids(ids, GenerationConfig(max_new_tokens=max_tokens))


def chat_reference(engine, text, max_tokens) -> Finished:
    return reference(engine, engine.chat_prompt([{"role": "user", "content": text}]), max_tokens)


def test_chat_and_completions_streaming_and_not(client, engine):
    question = "Name three primary colors."
    ref = chat_reference(engine, question, 24)
    messages = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == ref.text
    assert reply.choices[0].finish_reason == ref.finish_reason
    assert reply.usage.prompt_tokens == len(engine.chat_prompt(messages))
    assert reply.usage.completion_tokens == len(ref.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text

    prompt = "The three largest cities in Europe are"
    ref = reference(engine, list(engine.target.tokenizer(prompt)["input_ids"]), 16)
    done = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    assert done.choices[0].text == ref.text and done.usage.completion_tokens == 16
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref.text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_doctor_reproduces_the_accept_length_this_server_counts_over_its_prompts(server, smollm2):
    """`eaglewire doctor --server`: the doctor sends its live prompts and reads the counters over them; the
    answers are its live continuations token for token, and the declared wiring's walk over them reproduces
    the served figure."""
    report = run_doctor(DoctorConfig(checkpoint="shipped", server=server, live_prompts=2, live_tokens=32), target=smollm2)
    observed = report.result("acceptance.observed")
    assert "of the doctor's 2 live prompts" in observed.data["served_from"], observed.data["served_from"]
    assert "token for token as the live continuations" in observed.detail, observed.detail
    assert observed.status == PASS and "the declared wiring reproduces it" in observed.detail, observed.detail
    assert "layer1.out,layer14.out,layer26.out" in observed.data["reproduced_by"]


def doctor_on_a_server(smollm2, options: list[str]):
    """acceptance.observed of `doctor shipped --server` on a server started with ``options`` for it alone."""
    server = launch(["--max-len", str(MAX_LEN), "--log-interval", "600", *options])
    try:
        report = run_doctor(DoctorConfig(checkpoint="shipped", server=server.url, live_prompts=2, live_tokens=32),
                            target=smollm2)
    finally:
        server.stop()
    return report.result("acceptance.observed")


def test_the_doctor_walks_a_server_that_drafts_from_the_context(smollm2):
    """`serve --lookup-min 3`: steps whose drafts the context gave count apart from the drafter's, and the
    doctor, reading how the server drafts from its /metrics (chain length, min_confidence, lookup), walks
    the same steps: it reproduces the drafter's own accept length and the looked-up steps' count."""
    observed = doctor_on_a_server(smollm2, ["--lookup-min", "3"])
    assert "token for token as the live continuations" in observed.detail, observed.detail
    assert observed.status == PASS and "the declared wiring reproduces it" in observed.detail, observed.detail
    declared = next(row for row in observed.data["rows"] if row["wiring"] == "layer1.out,layer14.out,layer26.out")
    assert observed.data["observed_lookup_steps"] > 0
    assert declared["lookup_steps"] == observed.data["observed_lookup_steps"], observed.detail
    assert "ending after a draft below 0.5 confidence" in observed.detail


def test_a_server_that_feeds_the_shipped_drafter_other_layers_is_named(smollm2, tmp_path):
    """A copy of the shipped drafter whose config names embed,layer1.out,layer14.out (an engine that captures
    the embedding for the deepest id, concatenating in stream order) served for real: the doctor, given only
    the shipped checkpoint and the server, fails and names that wiring."""
    loaded = load_checkpoint(shipped_drafter(MODEL), smollm2.layout.embed)
    miswired = Wiring.parse("embed,layer1.out,layer14.out")
    folder = save_checkpoint(tmp_path / "miswired", loaded.drafter, replace(loaded.meta, wiring=miswired))
    observed = doctor_on_a_server(smollm2, ["--drafter", str(folder)])
    assert observed.status == FAIL, observed.detail
    assert str(miswired) in observed.data["reproduced_by"], observed.detail
    assert str(loaded.meta.wiring) not in observed.data["reproduced_by"]
    assert str(miswired) in observed.fix


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a fact about owls."}], temperature=0.8,
              top_p=0.95, seed=7, max_tokens=16)
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_sixteen_concurrent_clients_get_their_solo_answers(client, engine):
    questions = [f"Give one word that rhymes with {w}." for w in
                 ("cat", "dog", "sun", "tree", "blue", "rain", "light", "stone", "fire", "sea", "moon", "star",
                  "bird", "cold", "green", "hand")]
    expected = [chat_reference(engine, q, 10).text for q in questions]

    def ask(question):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                              temperature=0, max_tokens=10).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, questions))
    assert answers == expected


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 2}
BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({**GOOD, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({**GOOD, "model": "gpt-17"}).encode(), 404, "model"),
    (json.dumps({**GOOD, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({**GOOD, "max_tokens": MAX_LEN}).encode(), 400, "max_tokens"),
    (json.dumps({**GOOD, "messages": [{"role": "user", "content": "word " * MAX_LEN}]}).encode(), 400, "messages"),
    (json.dumps({**GOOD, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({**GOOD, "temperature": 50}).encode(), 400, "temperature"),
    (json.dumps({**GOOD, "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({**GOOD, "top_p": 3}).encode(), 400, "top_p"),
    (json.dumps({**GOOD, "stop": ""}).encode(), 400, "stop"),
    (json.dumps({**GOOD, "n": 2}).encode(), 400, "n"),
    (json.dumps({**GOOD, "stream_options": "usage"}).encode(), 400, "stream_options"),
    (json.dumps({**GOOD, "padding": "x" * (2 << 20)}).encode(), 413, None),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(server, body, status, param):
    response = httpx.post(server + "/v1/chat/completions", content=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    follow = httpx.post(server + "/v1/chat/completions", json=GOOD, timeout=60)
    assert follow.status_code == 200 and follow.json()["choices"][0]["message"]["content"]


def test_completions_bad_input(server):
    response = httpx.post(server + "/v1/completions", json={"model": MODEL, "max_tokens": 3}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_a_disconnected_stream_does_not_stall_the_others(server):
    body = {**GOOD, "max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # the client is gone after two chunks; the engine must move on at once, not finish 400 tokens (~20 s)
    start = time.time()
    follow = httpx.post(server + "/v1/chat/completions", json=GOOD, timeout=60)
    assert follow.status_code == 200 and time.time() - start < 8
    metrics = httpx.get(server + "/metrics").text
    for name in ("eaglewire_draft_tokens_total", "eaglewire_accepted_tokens_total", "eaglewire_generated_tokens_total",
                 "eaglewire_request_latency_seconds_bucket", "eaglewire_time_to_first_token_seconds_bucket",
                 'eaglewire_accepted_tokens_per_position_total{position="1"}'):
        assert name in metrics


class BlockingEngine:
    """Holds the worker on its first request until released."""

    cache = runner = None
    capture = ()

    def __init__(self):
        self.release = threading.Event()

    def start(self, prompt_ids, config, slot, may_draft):
        def steps():
            self.release.wait(10)
            yield Finished("", [], "stop", GenerationMetrics())
        return steps()


def test_a_full_queue_is_refused_at_once():
    engine = BlockingEngine()
    scheduler = Scheduler(engine, max_queue=2, on_finished=lambda job, event: None, log_interval=60)
    scheduler.start()
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job([1], GenerationConfig(), loop) for _ in range(4)]
        scheduler.submit(jobs[0])
        time.sleep(0.2)  # the worker takes the first job and blocks
        scheduler.submit(jobs[1])
        scheduler.submit(jobs[2])
        with pytest.raises(QueueFull):
            scheduler.submit(jobs[3])
        engine.release.set()  # the accepted jobs finish and deliver their events before the loop closes
        for job in jobs[:3]:
            events = [loop.run_until_complete(asyncio.wait_for(job.events.get(), 10)) for _ in range(2)]
            assert [type(event) for event in events] == [Started, Finished]
    finally:
        engine.release.set()
        scheduler.stop()
        loop.close()



class EndlessEngine:
    """Every request generates one token per step until it is ended."""

    cache = runner = None
    capture = ()

    def __init__(self):
        self.lean = self  # the scheduler's Batch runs the forward as engine.lean.forward_batch

    def forward_batch(self, calls, capture):
        time.sleep(0.005)
        return [None] * len(calls)

    def start(self, prompt_ids, config, slot, may_draft):
        def steps():
            tokens, metrics = [], GenerationMetrics()
            while True:
                yield SequenceCall(None, torch.tensor([0]), torch.tensor([0]))
                tokens.append(0)
                metrics.record_step(0, 0, 0)
                yield Chunk("x", list(tokens), [], metrics)
        return steps()


def test_a_drain_fails_queued_jobs_and_ends_running_ones_at_the_deadline():
    scheduler = Scheduler(EndlessEngine(), max_queue=4, on_finished=lambda job, event: None, log_interval=60)
    scheduler.start()
    loop = asyncio.new_event_loop()

    def events_until_the_end(job) -> list:
        events = []
        while not events or isinstance(events[-1], (Started, Chunk)):
            events.append(loop.run_until_complete(asyncio.wait_for(job.events.get(), 10)))
        return events

    try:
        running, queued = Job([1], GenerationConfig(), loop), Job([1], GenerationConfig(), loop)
        scheduler.submit(running)
        time.sleep(0.1)
        scheduler.submit(queued)  # the batch (max_batch 1) is full: it waits
        scheduler.drain(0.3)
        with pytest.raises(ShuttingDown):
            scheduler.submit(Job([1], GenerationConfig(), loop))
        assert [type(event) for event in events_until_the_end(queued)] == [ShuttingDown]
        assert queued.events.empty()
        events = events_until_the_end(running)
        assert isinstance(events[0], Started) and isinstance(events[-1], ShuttingDown)
        assert events[-1].tokens == len(events[-2].token_ids) > 10  # it ran until the deadline, then ended
    finally:
        scheduler.stop()
        loop.close()
