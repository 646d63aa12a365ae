"""The canonical wiring vocabulary: parsing, printing, ordering, defaults and reachability."""

from __future__ import annotations

import json

import pytest

from eaglewire.wiring import CapturePoint, Wiring, WiringError, all_points

SMOLLM2_LAYERS = 30


# ---------------------------------------------------------------- capture points


@pytest.mark.parametrize(
    "name, depth",
    [("embed", -1), ("layer0.out", 0), ("layer14.out", 14), ("layer29.out", 29), ("final", CapturePoint.FINAL_DEPTH)],
)
def test_capture_point_parse_and_print_round_trip(name, depth):
    point = CapturePoint.parse(name)
    assert point.depth == depth
    assert str(point) == name
    assert CapturePoint.parse(str(point)) == point


def test_capture_point_kinds():
    assert CapturePoint.parse("embed").is_embed and not CapturePoint.parse("embed").is_final
    assert CapturePoint.parse("final").is_final and not CapturePoint.parse("final").is_embed
    layer = CapturePoint.parse("layer14.out")
    assert not layer.is_embed and not layer.is_final
    assert layer.layer == 14
    assert CapturePoint.layer_out(14) == layer


@pytest.mark.parametrize("name", ["embed", "final"])
def test_layer_index_only_for_layer_outputs(name):
    with pytest.raises(WiringError, match="not a decoder-layer output"):
        CapturePoint.parse(name).layer


def test_layer_out_refuses_negative_index():
    with pytest.raises(WiringError, match=">= 0"):
        CapturePoint.layer_out(-1)


@pytest.mark.parametrize(
    "bad", ["layer-1.out", "layer01.out", "layer3", "Layer3.out", "", "layer3.in", "layer3.out.x", "3", "EMBED"]
)
def test_malformed_capture_point_names_raise_helpful_error(bad):
    with pytest.raises(WiringError) as err:
        CapturePoint.parse(bad)
    message = str(err.value)
    assert repr(bad) in message  # names what was given
    # ... and says what is accepted, with an example.
    for expected in ("'embed'", "'layer<i>.out'", "'final'", "layer14.out"):
        assert expected in message


def test_wiring_error_is_a_value_error():
    assert issubclass(WiringError, ValueError)


def test_order_follows_stream_depth():
    names = ["final", "layer29.out", "embed", "layer10.out", "layer0.out", "layer2.out"]
    ordered = sorted(CapturePoint.parse(n) for n in names)
    assert [str(p) for p in ordered] == ["embed", "layer0.out", "layer2.out", "layer10.out", "layer29.out", "final"]
    embed, l0, l29, final = (CapturePoint.parse(n) for n in ("embed", "layer0.out", "layer29.out", "final"))
    assert embed < l0 < l29 < final
    # Numeric, not lexicographic: layer10 is deeper than layer9.
    assert CapturePoint.parse("layer9.out") < CapturePoint.parse("layer10.out")


def test_all_points_lists_every_tensor_in_stream_order():
    points = all_points(SMOLLM2_LAYERS)
    assert len(points) == SMOLLM2_LAYERS + 2
    assert [str(p) for p in points] == ["embed", *(f"layer{i}.out" for i in range(30)), "final"]
    assert points == sorted(points)
    assert len(set(points)) == len(points)
    for p in points:
        p.check_reachable(SMOLLM2_LAYERS)  # every listed point exists in the target


@pytest.mark.parametrize("n", [1, 6])
def test_all_points_small_targets(n):
    assert [str(p) for p in all_points(n)] == ["embed", *(f"layer{i}.out" for i in range(n)), "final"]


def test_check_reachable_names_the_valid_range():
    CapturePoint.parse("layer29.out").check_reachable(SMOLLM2_LAYERS)
    with pytest.raises(WiringError) as err:
        CapturePoint.parse("layer30.out").check_reachable(SMOLLM2_LAYERS)
    message = str(err.value)
    assert "layer30.out" in message
    assert "30 decoder layers" in message
    assert "layer0.out to layer29.out" in message
    # embed and final exist in every target.
    CapturePoint.parse("embed").check_reachable(1)
    CapturePoint.parse("final").check_reachable(1)


# ---------------------------------------------------------------- wirings


@pytest.mark.parametrize(
    "text",
    ["layer1.out,layer14.out,layer26.out", "embed", "layer0.out", "embed,layer0.out,layer29.out", "layer26.out,layer1.out"],
)
def test_wiring_parse_and_print_round_trip(text):
    wiring = Wiring.parse(text)
    assert str(wiring) == text
    assert Wiring.parse(str(wiring)) == wiring
    assert [str(p) for p in wiring.aux] == text.split(",")
    assert wiring.teacher.is_final


def test_wiring_keeps_the_given_order():
    # The fc concatenates in this order: it is part of the wiring, never sorted away.
    forward, backward = Wiring.parse("layer1.out,layer26.out"), Wiring.parse("layer26.out,layer1.out")
    assert forward != backward
    assert [p.layer for p in backward.aux] == [26, 1]


def test_wiring_parse_tolerates_spaces_around_names():
    assert Wiring.parse(" layer1.out , layer14.out,layer26.out ") == Wiring.parse("layer1.out,layer14.out,layer26.out")


@pytest.mark.parametrize("text", ["", "   ", ",", ",,"])
def test_empty_wiring_raises(text):
    with pytest.raises(WiringError, match="empty wiring.*layer1.out,layer14.out,layer26.out"):
        Wiring.parse(text)


@pytest.mark.parametrize("text", ["layer1.out,,", "layer1.out,", ",layer1.out", "layer1.out,,layer26.out"])
def test_stray_comma_raises_instead_of_dropping_a_point(text):
    with pytest.raises(WiringError) as err:
        Wiring.parse(text)
    assert "empty capture point" in str(err.value)
    assert repr(text) in str(err.value)


@pytest.mark.parametrize("text", ["layer1.out,layer-1.out", "layer1.out,layer01.out", "layer3", "Layer3.out,layer4.out"])
def test_wiring_with_malformed_point_raises(text):
    with pytest.raises(WiringError, match="unknown capture point"):
        Wiring.parse(text)


@pytest.mark.parametrize("text", ["layer1.out,layer1.out", "layer1.out,layer14.out,layer1.out", "embed,embed"])
def test_repeated_aux_points_raise(text):
    with pytest.raises(WiringError, match="repeat"):
        Wiring.parse(text)


def test_empty_aux_raises():
    with pytest.raises(WiringError, match="at least one aux"):
        Wiring(())


def test_teacher_must_be_final():
    with pytest.raises(WiringError, match="teacher must read 'final'"):
        Wiring((CapturePoint.parse("layer1.out"),), CapturePoint.parse("layer29.out"))


def test_points_are_aux_then_teacher():
    wiring = Wiring.parse("layer26.out,layer1.out")
    assert [str(p) for p in wiring.points] == ["layer26.out", "layer1.out", "final"]


def test_default_for_smollm2_is_layer1_14_26():
    wiring = Wiring.default(SMOLLM2_LAYERS)
    assert str(wiring) == "layer1.out,layer14.out,layer26.out"
    assert wiring == Wiring.parse("layer1.out,layer14.out,layer26.out")
    assert wiring.teacher.is_final


@pytest.mark.parametrize(
    "n, expected",
    [
        (7, "layer1.out,layer2.out,layer3.out"),
        (16, "layer1.out,layer7.out,layer12.out"),
        (24, "layer1.out,layer11.out,layer20.out"),
        (31, "layer1.out,layer14.out,layer27.out"),
        (32, "layer1.out,layer15.out,layer28.out"),
        (80, "layer1.out,layer39.out,layer76.out"),
    ],
)
def test_default_for_other_depths(n, expected):
    wiring = Wiring.default(n)
    assert str(wiring) == expected
    wiring.check_reachable(n)
    assert list(wiring.aux) == sorted(wiring.aux)  # shallow to deep


@pytest.mark.parametrize("n", [0, 1, 4, 5, 6])
def test_default_refuses_too_shallow_targets(n):
    # Below 7 layers the three default points coincide (n=6 gives layer1, layer2, layer2).
    with pytest.raises(WiringError) as err:
        Wiring.default(n)
    message = str(err.value)
    assert "at least 7 decoder layers" in message
    assert f"has {n}" in message
    assert "--wiring" in message


def test_wiring_check_reachable():
    Wiring.parse("layer1.out,layer14.out,layer29.out").check_reachable(SMOLLM2_LAYERS)
    with pytest.raises(WiringError, match="layer0.out to layer29.out") as err:
        Wiring.parse("layer1.out,layer14.out,layer30.out").check_reachable(SMOLLM2_LAYERS)
    assert "layer30.out" in str(err.value)


def test_json_round_trip():
    wiring = Wiring.parse("embed,layer1.out,layer14.out,layer26.out")
    record = wiring.to_json()
    assert record == {"aux": ["embed", "layer1.out", "layer14.out", "layer26.out"], "teacher": "final"}
    # Survives serialisation to text, as it does in a manifest or a checkpoint config.
    assert Wiring.from_json(json.loads(json.dumps(record))) == wiring


@pytest.mark.parametrize(
    "record",
    [
        {"aux": ["layer1.out"], "teacher": "final", "extra": 1},
        {"aux": ["layer1.out"], "teacher": "final", "layer_ids": [2]},
        {"aux": ["layer1.out"]},
        {"teacher": "final"},
        {},
    ],
)
def test_from_json_requires_exactly_aux_and_teacher(record):
    with pytest.raises(WiringError, match="exactly the keys 'aux' and 'teacher'") as err:
        Wiring.from_json(record)
    assert str(sorted(record)) in str(err.value)


def test_from_json_validates_names_and_teacher():
    with pytest.raises(WiringError, match="unknown capture point"):
        Wiring.from_json({"aux": ["layer01.out"], "teacher": "final"})
    with pytest.raises(WiringError, match="teacher must read 'final'"):
        Wiring.from_json({"aux": ["layer1.out"], "teacher": "layer29.out"})
    with pytest.raises(WiringError, match="repeat"):
        Wiring.from_json({"aux": ["layer1.out", "layer1.out"], "teacher": "final"})
