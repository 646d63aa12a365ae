"""Engine layer-id conventions: which canonical tensors an ``eagle_aux_hidden_state_layer_ids`` list names.

Worked examples are pinned for the 30-layer SmolLM2 target. Where the capture loop was
read (vLLM @e06c9ba, SGLang @bf7a0e2, SpecForge's HF hooks) it is re-enacted here in a
few lines and compared with the module, so the tests do not just restate its arithmetic.
"""

from __future__ import annotations

import itertools

import pytest

from eaglewire.engine_ids import CONVENTIONS, convention
from eaglewire.wiring import Wiring, WiringError

N = 30  # SmolLM2-135M decoder layers
TRAINED = Wiring.parse("layer1.out,layer14.out,layer26.out")
ALL = sorted(CONVENTIONS)


def layers(*indices: int) -> Wiring:
    return Wiring.parse(",".join(f"layer{i}.out" for i in indices))


# ---------------------------------------------------------------- worked examples (SmolLM2, 30 layers)

WORKED = {
    "eagle": [2, 15, 27],
    "vllm": [2, 15, 27],
    "speculators": [2, 15, 27],
    "specforge": [1, 14, 26],
    "sglang-pre-25454": [1, 14, 26],
    "sglang-post-25454": [1, 14, 26],
}


def test_worked_examples_cover_every_convention():
    assert set(WORKED) == set(CONVENTIONS)


@pytest.mark.parametrize("name, ids", sorted(WORKED.items()))
def test_worked_example_ids_for_smollm2(name, ids):
    conv = convention(name)
    assert conv.to_ids(TRAINED, N) == ids
    assert conv.from_ids(ids, N) == TRAINED


def test_convention_lookup_returns_the_registered_convention():
    for name in ALL:
        assert convention(name) is CONVENTIONS[name]
        assert convention(name).name == name


def test_unknown_convention_lists_the_known_ones():
    with pytest.raises(WiringError) as err:
        convention("tensorrt-llm")
    message = str(err.value)
    assert "'tensorrt-llm'" in message
    for name in ALL:
        assert name in message


# ---------------------------------------------------------------- defaults


@pytest.mark.parametrize(
    "name, ids",
    [
        ("eagle", [2, 15, 27]),
        ("vllm", [2, 15, 27]),
        ("speculators", [2, 15, 27]),
        ("specforge", [1, 14, 26]),
        # Explicit ids that SGLang shifts; its unshifted None default [2, 15, 27] names the same tensors.
        ("sglang-pre-25454", [1, 14, 26]),
        ("sglang-post-25454", [2, 15, 27]),
    ],
)
def test_default_ids_for_smollm2(name, ids):
    assert convention(name).default_ids(N) == ids


@pytest.mark.parametrize("n", [7, 16, 24, 30, 32, 80])
@pytest.mark.parametrize("name", ALL)
def test_default_ids_read_back_as_the_canonical_default(name, n):
    conv = convention(name)
    assert conv.from_ids(conv.default_ids(n), n) == Wiring.default(n)
    written = [1, n // 2 - 1, n - 4] if name == "sglang-post-25454" else conv.default_ids(n)
    assert conv.to_ids(Wiring.default(n), n) == written


def test_sglang_post_writes_the_default_wiring_with_a_leading_1():
    # Both spellings read back as the default; to_ids prefers the +1-shifted one.
    conv = convention("sglang-post-25454")
    assert conv.to_ids(TRAINED, N) == [1, 14, 26]
    assert conv.from_ids([2, 15, 27], N) == conv.from_ids([1, 14, 26], N) == TRAINED


# ---------------------------------------------------------------- round trip sweep


def _expressible(name: str, n: int) -> list[int]:
    """Layer outputs (by index) each convention can name on an n-layer target, from the sources read."""
    if name in ("specforge", "speculators", "vllm"):
        return [0, 1, 2, n // 2 - 2, n // 2 - 1, n // 2, n - 4, n - 3, n - 2, n - 1]
    # eagle: the loop visits idx 0..n-1 (id n, i.e. layer{n-1}.out, is never reached);
    # sglang: id j is captured at slot j+1 <= n-1.
    return [0, 1, 2, n // 2 - 2, n // 2 - 1, n // 2, n - 4, n - 3, n - 2]


def _sweep():
    for name in ALL:
        for combo in itertools.combinations(_expressible(name, N), 3):
            if name == "sglang-post-25454" and combo[0] == 0:
                continue  # layer0.out first: see test_sglang_post_refuses_layer0_first
            yield pytest.param(name, combo, id=f"{name}-{'-'.join(map(str, combo))}")


@pytest.mark.parametrize("name, combo", list(_sweep()))
def test_round_trip_every_expressible_wiring(name, combo):
    conv = convention(name)
    wiring = layers(*combo)
    ids = conv.to_ids(wiring, N)
    assert conv.from_ids(ids, N) == wiring
    meaning_shift = {
        "eagle": 1,
        "vllm": 1,
        "speculators": 1,
        "specforge": 0,
        "sglang-pre-25454": 0,
        "sglang-post-25454": 0 if combo[0] == 1 else 1,
    }[name]
    assert ids == [i + meaning_shift for i in combo]


@pytest.mark.parametrize("name", ALL)
def test_aux_points_out_of_stream_order_are_refused(name):
    # Every engine appends captured states inside its decoder loop, i.e. shallow to deep, so
    # a wiring that lists a deeper point first would feed the fc its tensors in another order.
    conv = convention(name)
    for combo in itertools.permutations([1, 14, 26]):
        if list(combo) == [1, 14, 26]:
            continue
        with pytest.raises(WiringError, match="stream order"):
            conv.to_ids(layers(*combo), N)


@pytest.mark.parametrize("name", ["eagle", "vllm", "speculators", "specforge", "sglang-pre-25454"])
def test_from_ids_reports_tensors_in_the_order_the_engine_appends_them(name):
    conv = convention(name)
    ids = conv.to_ids(TRAINED, N)
    assert conv.from_ids(list(reversed(ids)), N) == TRAINED


# ---------------------------------------------------------------- the engines' capture loops, re-enacted


def _entering(slot: int) -> str:
    return "embed" if slot == 0 else f"layer{slot - 1}.out"


def _vllm_0_33_0(ids, n):
    """vllm 0.33.0 LlamaModel.forward: _maybe_add_hidden_state at slot 0 before the loop (the embedding alone,
    the residual being None), then at slot idx + 1 after layer idx (hidden_states + residual)."""
    out = ["embed"] if 0 in ids else []
    for idx in range(n):
        if idx + 1 in ids:
            out.append(f"layer{idx}.out")
    return out


def _sglang_bf7a0e2(slots, n):
    """LlamaModel.forward: for i in range(n), if i in layers_to_capture append hidden_states + residual."""
    out = []
    for i in range(n):
        if i in slots:
            if i == 0:
                raise TypeError("hidden_states + None")
            out.append(_entering(i))
    return out


def _sglang_pre(ids, n):
    return _sglang_bf7a0e2([j + 1 for j in ids], n)


def _sglang_post(ids, n):
    return _sglang_bf7a0e2([j + 1 for j in ids] if ids[0] == 1 else list(ids), n)


def _specforge_hf_hooks(ids, n):
    """Forward hooks on layers[j] fire in forward order and see layer j's output."""
    if any(not 0 <= j < n for j in ids):
        raise IndexError("layers[j]")
    return [f"layer{j}.out" for j in range(n) if j in ids]


ENGINE_LOOPS = {
    "vllm": _vllm_0_33_0,
    "sglang-pre-25454": _sglang_pre,
    "sglang-post-25454": _sglang_post,
    "specforge": _specforge_hf_hooks,
}


@pytest.mark.parametrize("n", [7, N])
@pytest.mark.parametrize("name", sorted(ENGINE_LOOPS))
def test_from_ids_agrees_with_the_engine_capture_loop(name, n):
    """For every ordered id triple near the edges and the middle, either the module names exactly the
    tensors the engine loop appends (in its order), or the engine would crash or drop an id and the
    module refuses."""
    conv, loop = convention(name), ENGINE_LOOPS[name]
    candidates = sorted({0, 1, 2, n // 2 - 1, n // 2, n - 3, n - 2, n - 1, n, n + 1})
    checked = refused = 0
    for ids in itertools.permutations(candidates, 3):
        try:
            captured = loop(list(ids), n)
        except (TypeError, IndexError):
            captured = None
        if captured is None or len(captured) != len(ids):
            with pytest.raises(WiringError):
                conv.from_ids(list(ids), n)
            refused += 1
        else:
            assert str(conv.from_ids(list(ids), n)) == ",".join(captured), ids
            checked += 1
    assert checked > 100 and refused > 100  # both branches were exercised


@pytest.mark.parametrize("name", sorted(ENGINE_LOOPS))
def test_to_ids_captures_the_wiring_in_the_engine_loop(name):
    loop = ENGINE_LOOPS[name]
    for combo in itertools.combinations(range(N), 3):
        wiring = layers(*combo)
        try:
            ids = convention(name).to_ids(wiring, N)
        except WiringError:
            continue
        assert loop(ids, N) == [str(p) for p in wiring.aux], (combo, ids)


# ---------------------------------------------------------------- the classic miswiring


def test_vllm_ids_read_by_sglang_pre_name_other_tensors():
    vllm_ids = convention("vllm").to_ids(TRAINED, N)
    assert vllm_ids == [2, 15, 27]
    read = convention("sglang-pre-25454").from_ids(vllm_ids, N)
    assert read == layers(2, 15, 27)
    assert read != TRAINED
    # Every point is one layer too deep: same shapes, different tensors.
    assert [p.layer for p in read.aux] == [p.layer + 1 for p in TRAINED.aux]


def test_sglang_post_reads_both_spellings_as_the_trained_tensors():
    post = convention("sglang-post-25454")
    assert post.from_ids([2, 15, 27], N) == TRAINED  # verbatim slots
    assert post.from_ids([1, 14, 26], N) == TRAINED  # leading 1: shifted
    # Without the leading 1 the same SpecForge-style ids are taken verbatim: one layer shallower.
    assert convention("specforge").from_ids([3, 14, 26], N) == layers(3, 14, 26)
    assert post.from_ids([3, 14, 26], N) == layers(2, 13, 25)


# ---------------------------------------------------------------- what cannot be expressed


def test_embed_is_id_0_in_vllm_0_33_and_speculators_0_9():
    # vllm 0.33.0 llama.py offers the stream before layer 0 (the embedding alone: the residual is still None);
    # speculators 0.9.0 resolve_target_layer_ids accepts ids in [0, n]. EAGLE's hard-coded ids never reach 0.
    wiring = Wiring.parse("embed,layer14.out,layer26.out")
    for name in ("vllm", "speculators"):
        assert convention(name).to_ids(wiring, N) == [0, 15, 27]
        assert convention(name).from_ids([0, 15, 27], N) == wiring
    with pytest.raises(WiringError, match=r"eagle cannot capture ids \[0\].*only reaches ids 1\.\."):
        convention("eagle").to_ids(wiring, N)


@pytest.mark.parametrize("name", sorted(set(ALL) - {"vllm", "speculators"}))
def test_embed_is_expressible_nowhere_else(name):
    with pytest.raises(WiringError, match="embed|ids \\[0\\]"):
        convention(name).to_ids(Wiring.parse("embed,layer14.out"), N)


@pytest.mark.parametrize("name", ALL)
def test_final_is_never_expressible(name):
    with pytest.raises(WiringError, match="no engine captures it"):
        convention(name).to_ids(Wiring.parse("layer1.out,final"), N)
    with pytest.raises(WiringError, match="no engine captures it"):
        convention(name).to_ids(Wiring.parse("final"), N)


@pytest.mark.parametrize("name", ALL)
def test_points_beyond_the_target_are_refused_before_any_id_is_written(name):
    with pytest.raises(WiringError, match="layer0.out to layer29.out"):
        convention(name).to_ids(layers(1, 14, 30), N)


def test_last_layer_is_unreachable_for_sglang_pre():
    conv = convention("sglang-pre-25454")
    with pytest.raises(WiringError) as err:
        conv.to_ids(layers(1, 14, 29), N)
    message = str(err.value)
    assert "cannot capture ids [29]" in message
    assert "only reaches ids 0..28" in message
    assert "30-layer target" in message
    # One layer earlier is fine.
    assert conv.to_ids(layers(1, 14, 28), N) == [1, 14, 28]


def test_ids_beyond_n_are_unreachable_for_vllm_0_33():
    # Slot n is offered after the last layer (layer{n-1}.out); nothing lies beyond it.
    with pytest.raises(WiringError, match=r"cannot capture ids \[31\].*only reaches ids 0\.\.30"):
        convention("vllm").from_ids([2, 15, 31], N)


@pytest.mark.parametrize("name, ids", [("specforge", [1, 14, 29]), ("speculators", [2, 15, 30]), ("vllm", [2, 15, 30])])
def test_last_layer_is_reachable_where_the_source_reaches_it(name, ids):
    assert convention(name).to_ids(layers(1, 14, 29), N) == ids


def test_sglang_post_refuses_layer0_first():
    conv = convention("sglang-post-25454")
    with pytest.raises(WiringError) as err:
        conv.to_ids(layers(0, 14, 26), N)
    message = str(err.value)
    assert "sglang-post-25454 cannot express layer0.out,layer14.out,layer26.out" in message
    assert "first id is 1" in message
    # The input-of-layer spelling [1, 15, 27] starts with 1, so SGLang would shift it.
    assert "[1, 15, 27] are read as layer1.out,layer15.out,layer27.out" in message
    # Other conventions can express it.
    assert convention("sglang-pre-25454").to_ids(layers(0, 14, 26), N) == [0, 14, 26]
    assert convention("vllm").to_ids(layers(0, 14, 26), N) == [1, 15, 27]


def test_repeated_ids_are_refused():
    # The engines test membership (`idx in ids`), so a repeated id yields one tensor, not two.
    with pytest.raises(WiringError, match="repeat"):
        convention("vllm").from_ids([2, 2, 27], N)
