"""Byte-exact JSON edits: spans found in any spelling of an object, members removed exactly."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from sidecar.metering import splice

keys = st.sampled_from(["usage", "choices", "id"]) | st.text(min_size=1, max_size=6)
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)
objects = st.dictionaries(keys, values, max_size=6)
spellings = st.sampled_from(
    [
        {"separators": (",", ":")},
        {"separators": (", ", ": ")},
        {"indent": 2},
        {"ensure_ascii": False},
    ]
)


@given(objects, spellings)
def test_member_spans_hold_each_value(obj: dict, spelling: dict) -> None:
    text = json.dumps(obj, **spelling)
    found = splice.members(text)
    assert found is not None and [m.key for m in found] == list(obj)
    for m in found:
        assert json.loads(text[m.value_start : m.value_end]) == obj[m.key]
        assert json.loads(text[m.start : m.value_start].rstrip().rstrip(":")) == m.key


@given(objects, spellings, st.data())
def test_without_removes_exactly_one_member(obj: dict, spelling: dict, data: st.DataObject) -> None:
    text = json.dumps(obj, **spelling)
    if not obj:
        assert splice.without(text, "usage") is None
        return
    key = data.draw(st.sampled_from(["usage", *obj] if "usage" in obj else list(obj)))
    cut = splice.without(text, key)
    assert cut is not None
    rest = {k: v for k, v in obj.items() if k != key}
    assert json.loads(cut) == rest
    if spelling == {"separators": (",", ":")}:  # compact: exactly what a server would have sent
        assert cut == json.dumps(rest, separators=(",", ":"))


def test_not_an_object() -> None:
    assert splice.members("[1, 2]") is None
    assert splice.members('{"a": 1,}') is None
    assert splice.without('{"a": {"usage": 1}}', "usage") is None  # only top-level members
