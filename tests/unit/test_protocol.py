"""The control channel's wire format: every message round-trips, and no bytes a peer can
send make ``decode`` fail with anything but ProtocolError."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perdure.runtime.control import protocol as p

SAMPLES: list[p.Message] = [
    p.Hello(
        name="eu-0",
        region="eu",
        role="worker",
        pid=7,
        next_step=3,
        has_state=True,
        epoch=2,
        mac="ab",
    ),
    p.Heartbeat(next_step=4, prepared=True, slot_s=0.012),
    p.Heartbeat(next_step=0, prepared=False),
    p.Ready(epoch=3, next_step=9, has_state=False),
    p.Fail(epoch=3, error="Connection closed by peer"),
    p.Leave(),
    p.Evict(worker="eu-1", reason="non-finite results"),
    p.Done(next_step=100, final_hash="sha256:00"),
    p.Challenge(nonce="n"),
    p.Challenge(nonce="n", generation=3, serving=True),
    p.Welcome(
        config={"train": {"slots": 8}},
        run_dir="/r",
        resume=None,
        store_port=1,
        epoch=-1,
        generation=2,
    ),
    p.Refused(reason="bad run token"),
    p.Refused(reason="standby: the primary holds the run's lease", retry=True),
    p.Announce(epoch=4, members=["a", "b"], after=-1, generation=2),
    p.Start(
        epoch=4,
        plan={"members": ["a"], "ranges": [[0, 8]]},
        start_step=5,
        source="a",
        receivers=[],
        recover=False,
        reload=None,
        prefix="pg/4/x/",
        generation=2,
    ),
    p.Stop(reason="run complete"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_every_message_round_trips(msg: p.Message) -> None:
    line = p.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert p.decode(line[:-1]) == msg


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        (b"this is not json", "not a JSON line"),
        (b"5", "a message is a JSON object"),
        (b"\xff\xfe", "not a JSON line"),
        (b'{"type": "nope"}', "unknown message type"),
        (b'{"type": "hb"}', "missing field 'next_step'"),
        (b'{"type": "hb", "next_step": "3", "prepared": true}', "expected int"),
        (b'{"type": "hb", "next_step": true, "prepared": true}', "expected int"),
        (b'{"type": "hb", "next_step": 1, "prepared": 1}', "expected bool"),
        (b'{"type": "hb", "next_step": 1e400, "prepared": true}', "expected int"),
        (b'{"type": "hb", "next_step": 1, "prepared": true, "slot_s": NaN}', "NaN is not JSON"),
        (b'{"type": "hb", "next_step": 1, "prepared": true, "x": 1}', "unknown field 'x'"),
        (b'{"type": "hb", "next_step": 99999999999999999999, "prepared": true}', "out of range"),
        (
            b'{"type": "epoch", "epoch": 1, "members": [1], "after": 0, "generation": 1}',
            "expected str",
        ),
        (b'{"type": "epoch", "epoch": 1, "members": [], "after": 0}', "missing field 'generation'"),
        (b'{"type": "refused", "reason": "x", "retry": "yes"}', "expected bool"),
        (b'{"type": "leave"' + b"}" * 3, "not a JSON line"),
        (b"[" * 100000 + b"]" * 100000, "not a JSON line"),
    ],
)
def test_malformed_lines_raise_a_protocol_error_naming_the_rule(line: bytes, rule: str) -> None:
    with pytest.raises(p.ProtocolError, match=rule.replace("(", r"\(")):
        p.decode(line)


def test_oversized_strings_lists_and_lines_are_refused() -> None:
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(json.dumps({"type": "refused", "reason": "x" * (p.MAX_STR + 1)}).encode())
    members = ["a"] * (p.MAX_LIST + 1)
    with pytest.raises(p.ProtocolError, match="exceed"):
        p.decode(json.dumps({"type": "epoch", "epoch": 1, "members": members, "after": 0}).encode())
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(b" " * (p.MAX_LINE + 1))


def test_a_line_buffer_bounds_what_it_holds_without_a_newline() -> None:
    buf = p.LineBuffer(max_line=100)
    assert buf.feed(b'{"type": "leave"}\n{"type": "le') == [p.Leave()]
    assert buf.feed(b'ave"}\n') == [p.Leave()]
    with pytest.raises(p.ProtocolError, match="without a newline"):
        buf.feed(b"x" * 101)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_objects = st.fixed_dictionaries(
    {"type": st.sampled_from([*sorted(p._TYPES), "x"])},
    optional={
        k: _json
        for k in ("name", "epoch", "members", "after", "next_step", "prepared", "slot_s", "mac")
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=200), _objects.map(lambda o: json.dumps(o).encode())))
def test_no_input_makes_decode_raise_anything_but_a_protocol_error(line: bytes) -> None:
    try:
        msg = p.decode(line)
    except p.ProtocolError:
        return
    assert p.decode(p.encode(msg)[:-1]) == msg  # whatever decodes is a valid message
