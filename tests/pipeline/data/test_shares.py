import numpy as np
import pytest

from pipeline.data.mixture import MixtureError, order_keys
from pipeline.data.shares import check_names, multiplicities


@pytest.mark.parametrize("huge", [[], [40_000, 25_000]])
def test_multiplicities_fall_short_by_less_than_the_shortest_document_left_out(huge):
    rng = np.random.default_rng(0)
    tokens = np.concatenate([rng.integers(1, 50, 500), huge]).astype(np.int64)
    keys = order_keys(7, [f"d{i}" for i in range(len(tokens))])
    total = int(tokens.sum())
    for target in (total // 3, total, 2 * total + total // 7, 10, total - 1):
        m = multiplicities(keys, tokens, target)
        got = int((m * tokens).sum())
        full = target // total
        assert m.min() >= full and m.max() <= full + 1
        assert got <= target
        left_out = tokens[m == full]
        assert target - got < (left_out.min() if len(left_out) else 1), (target, got)


def test_multiplicities_are_deterministic_and_follow_the_seed():
    tokens = np.arange(1, 201)
    a = multiplicities(order_keys(1, [str(i) for i in range(200)]), tokens, 5000)
    b = multiplicities(order_keys(1, [str(i) for i in range(200)]), tokens, 5000)
    c = multiplicities(order_keys(2, [str(i) for i in range(200)]), tokens, 5000)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_every_named_source_and_only_those_or_one_line_naming_them():
    check_names(["web", "code"], {"code": 1, "web": 2}, "pack.mixture", MixtureError)
    with pytest.raises(MixtureError, match=r"^pack.mixture has no entry for source\(s\) \['code'\]; list every"):
        check_names(["web", "code"], {"web": 1}, "pack.mixture", MixtureError)
    with pytest.raises(MixtureError, match=r"^pack.mixture has no entry for source\(s\) \['code'\] and names "
                                           r"\['cod'\], which no source with train documents is called; list every"):
        check_names(["web", "code"], {"web": 1, "cod": 1}, "pack.mixture", MixtureError)  # a misspelt name
    with pytest.raises(MixtureError, match=r"^tokenizer.sample_weights names source\(s\) \['math'\] that have no "
                                           r"train documents \(sources with train documents: \['web'\]\)"):
        check_names(["web"], {"web": 1, "math": 1}, "tokenizer.sample_weights", MixtureError)


def test_nothing_to_share_takes_nothing():
    assert multiplicities(np.arange(3), np.zeros(3, np.int64), 10).tolist() == [0, 0, 0]
    assert multiplicities(np.arange(3), np.array([1, 2, 3]), 12).tolist() == [2, 2, 2]
