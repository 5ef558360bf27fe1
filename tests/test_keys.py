from hypothesis import given
from hypothesis import strategies as st

from seqshard.formats.keys import escape_key, key_problem, split_member_name, unescape_key


def test_key_problems_name_the_character():
    assert key_problem("spk1-utt001") is None
    assert "empty" in key_problem("")
    assert "'.'" in key_problem("utt.1")
    assert "'/'" in key_problem("dir/utt")
    assert "whitespace" in key_problem("a b")


@given(st.text(min_size=1).filter(lambda k: not any(c.isspace() for c in k)))
def test_escaping_is_reversible_and_fits_the_member_convention(key):
    escaped = escape_key(key)
    assert key_problem(escaped) is None
    assert unescape_key(escaped) == key
    assert split_member_name(f"{escaped}.feats.npy") == (escaped, "feats.npy")


def test_member_names_split_like_webdataset():
    assert split_member_name("a/b/key.feats.npy") == ("a/b/key", "feats.npy")
    assert split_member_name("test/resources/dataset/aishell-BAC009S0724W0121.wav") == (
        "test/resources/dataset/aishell-BAC009S0724W0121",
        "wav",
    )
    assert split_member_name("README") is None
    assert split_member_name("dir/.hidden") is None
