"""The TOML writer: what tomllib reads back is what was written."""

from __future__ import annotations

import math
import tomllib

from hypothesis import given, strategies as st

from dispatch_amp.config import _toml

_KEYS = st.text(min_size=1, max_size=8, alphabet=st.characters(blacklist_categories=("Cs",)))
_SCALARS = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False),
                     st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=10))
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=4))
_TABLES = st.recursive(st.dictionaries(_KEYS, _VALUES, max_size=4),
                       lambda inner: st.dictionaries(_KEYS, st.one_of(_VALUES, inner), max_size=3), max_leaves=10)


@given(_TABLES)
def test_what_is_written_reads_back(data):
    assert tomllib.loads(_toml.dumps(data)) == data


def test_special_floats_and_lines():
    back = tomllib.loads(_toml.dumps({"a": math.inf, "b": -math.inf}))
    assert back == {"a": math.inf, "b": -math.inf}
    assert math.isnan(tomllib.loads(_toml.dumps({"n": math.nan}))["n"])
    text = 'kind = "policy"\n\n[rules]\nfp32 = [\n    "aten::mmm",\n]\n'
    assert _toml.line_of(text, "rules.fp32", "aten::mmm") == 5
    assert _toml.line_of(text, "rules", None) == 3
    assert _toml.line_of(text, "nothing", "absent") is None


def test_a_key_ending_in_a_newline_is_quoted():
    # A regular expression's "$" matches before a final newline: such a key is not bare.
    assert tomllib.loads(_toml.dumps({"0\n": False, "a b": {"c\n": 1}})) == {"0\n": False, "a b": {"c\n": 1}}
