"""Length groups: bounds that are not finite numbers are refused naming the option."""

import pytest

from seqshard.errors import ConfigError
from seqshard.prep.plan import parse_groups


@pytest.mark.parametrize("spec", ["nan:5", "0:inf", "1e400:1e401", "-inf:3"])
def test_bounds_that_are_not_finite_are_refused(spec):
    with pytest.raises(ConfigError, match=rf"filter_group={spec!r}: expected 'LOW:HIGH' in seconds"):
        parse_groups([spec], seconds=True)
    assert parse_groups(["0.5:2.5"], seconds=True)[0].high == 250
