"""Lock-step batching: each generation in a batch gives exactly what it gives alone."""

from __future__ import annotations

import pytest

from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.engine.batching import Batch
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.sampling import SamplingParams
from eaglewire.engine.speculative import (
    Chunk,
    Engine,
    EngineError,
    Finished,
    GenerationConfig,
)

REQUESTS = [
    ("Name three primary colors.", GenerationConfig(max_new_tokens=24)),
    ("Write a haiku about rain.", GenerationConfig(max_new_tokens=30, strategy="tree",
                                                   tree=TreeShape(depth=3, top_k=4, total_tokens=10))),
    ("What is 12 times 12?", GenerationConfig(max_new_tokens=16, strategy="none")),
    ("Tell me a fact about owls.", GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=0.8, seed=5))),
    ("Count from one to ten in words.", GenerationConfig(max_new_tokens=40)),  # a stop string is set below
    ("Why is the sky blue?", GenerationConfig(max_new_tokens=8, chain_length=2)),
]


@pytest.fixture(scope="module")
def engine(smollm2):
    checkpoint = load_checkpoint(shipped_drafter("smollm2-135m"), smollm2.layout.embed)
    return Engine(smollm2, checkpoint.drafter.float(), checkpoint.meta.wiring, max_len=256)


def drain(batch: Batch, queued: list, finished: dict, streamed: dict) -> None:
    """Admit queued (key, ids, config) while there is room, step until everything has finished."""
    def record(events):
        for key, event in events:
            assert not isinstance(event, Exception), event
            if isinstance(event, Chunk):
                streamed[key] = streamed.get(key, "") + event.text
            else:
                finished[key] = event

    while queued or batch.running:
        while queued and batch.has_room:
            record(batch.add(*queued.pop(0)))
        record(batch.step())


@pytest.mark.parametrize("draft_up_to", [None, 1], ids=["always-draft", "draft-alone"])
def test_batched_generations_equal_their_solo_runs(engine, draft_up_to):
    ids = [engine.chat_prompt(text) for text, _ in REQUESTS]
    # request 4 stops at a word from the middle of its own answer
    counting = engine.complete_ids(ids[4], REQUESTS[4][1]).text
    requests = list(REQUESTS)
    requests[4] = (REQUESTS[4][0], GenerationConfig(max_new_tokens=40, stop=(counting.split()[len(counting.split()) // 2],)))
    solo = [engine.complete_ids(i, config) for i, (_, config) in zip(ids, requests)]
    batch = Batch(engine, max_batch=3, draft_up_to=draft_up_to)  # six requests, three slots: later ones join mid-flight
    finished: dict[int, Finished] = {}
    streamed: dict[int, str] = {}
    drain(batch, [(k, ids[k], config) for k, (_, config) in enumerate(requests)], finished, streamed)
    for k, alone in enumerate(solo):
        if k == 3 and draft_up_to is not None:
            # A seeded sample follows the random draws, and acceptance draws once per draft: with other
            # drafts it is another sample of the same distribution (test_sampling), not the same one.
            assert len(finished[k].token_ids) == len(alone.token_ids)
            continue
        assert finished[k].token_ids == alone.token_ids, REQUESTS[k][0]
        assert finished[k].text == alone.text == streamed.get(k, "")
        assert finished[k].finish_reason == alone.finish_reason
    assert solo[4].finish_reason == "stop" and solo[5].finish_reason == "length"
    assert finished[2].metrics.drafted == 0  # strategy none
    if draft_up_to is None:
        assert finished[0].metrics.drafted > 0
    else:  # request 0 only ever ran beside others: every step plain
        assert finished[0].metrics.drafted == 0 < solo[0].metrics.drafted


def test_a_request_drafts_again_once_it_runs_alone(engine):
    batch = Batch(engine, max_batch=2, draft_up_to=1)
    long_ids, short_ids = engine.chat_prompt("Write a haiku about rain."), engine.chat_prompt("Why is the sky blue?")
    finished, streamed = {}, {}
    drain(batch, [("long", long_ids, GenerationConfig(max_new_tokens=30)),
                  ("short", short_ids, GenerationConfig(max_new_tokens=5))], finished, streamed)
    assert finished["short"].metrics.drafted == 0  # it never ran alone
    long = finished["long"].metrics
    assert 0 < long.drafted and long.verify_steps > 5  # plain while beside "short", drafting after
    assert finished["long"].token_ids == engine.complete_ids(long_ids, GenerationConfig(max_new_tokens=30)).token_ids
    assert batch.running == 0 and batch.has_room


def test_cancel_frees_the_slot_and_bad_requests_take_none(engine):
    batch = Batch(engine, max_batch=1)
    with pytest.raises(EngineError, match="empty"):
        batch.add("empty", [], GenerationConfig())
    assert batch.has_room
    batch.add("long", engine.chat_prompt("Write a long story."), GenerationConfig(max_new_tokens=200))
    batch.step()
    batch.step()
    assert not batch.has_room and batch.keys() == ["long"]
    batch.cancel("long")
    assert batch.has_room and batch.running == 0
    # the freed caches serve the next request exactly (nothing stale from the cancelled one)
    ids = engine.chat_prompt("Name three primary colors.")
    finished, streamed = {}, {}
    drain(batch, [("next", ids, GenerationConfig(max_new_tokens=24))], finished, streamed)
    assert finished["next"].token_ids == engine.complete_ids(ids, GenerationConfig(max_new_tokens=24)).token_ids
