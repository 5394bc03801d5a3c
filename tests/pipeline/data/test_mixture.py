import pytest
from pydantic import ValidationError

from pipeline.data.mixture import MixtureError, Share, empty_warnings, repeat_warnings, targets


def test_weights_share_the_weighted_tokens_and_budgets_are_exact():
    available = {"web": 900, "code": 100, "math": 50}
    mixture = {"web": Share(weight=0.5), "code": Share(weight=0.5), "math": Share(tokens=120)}
    assert targets(available, mixture) == {"web": 500, "code": 500, "math": 120}


@pytest.mark.parametrize("mixture, message", [
    ({"web": Share(weight=1)}, r"no entry for source\(s\) \['code'\]"),
    ({"web": Share(weight=1), "code": Share(weight=1), "math": Share(weight=1)}, r"names source\(s\) \['math'\]"),
])
def test_every_source_and_only_those(mixture, message):
    with pytest.raises(MixtureError, match=message):
        targets({"web": 10, "code": 10}, mixture)


def test_a_share_is_a_weight_or_a_budget():
    for bad in ({}, {"weight": 1, "tokens": 5}, {"weight": 0}, {"tokens": -1}, {"weight": float("inf")},
                {"weight": float("nan")}, {"tokens": 10**25}):
        with pytest.raises(ValidationError):
            Share(**bad)


def test_weights_near_the_largest_float_share_as_any_others():
    available = {"web": 900, "code": 100}
    assert targets(available, {"web": Share(weight=1e308), "code": Share(weight=1e308)}) == {"web": 500, "code": 500}
    assert targets(available, {"web": Share(weight=1.5e308), "code": Share(weight=0.5e308)}) == \
        targets(available, {"web": Share(weight=3), "code": Share(weight=1)}) == {"web": 750, "code": 250}
    # their sum is finite, but the pool times the larger one is not
    assert targets(available, {"web": Share(weight=1e308), "code": Share(weight=1e307)}) == {"web": 909, "code": 91}


def test_a_source_with_nothing_cannot_give_tokens():
    with pytest.raises(MixtureError, match="'code' has no train tokens"):
        targets({"web": 10, "code": 0}, {"web": Share(weight=1), "code": Share(tokens=5)})


def test_too_many_repeats_is_a_warning_with_the_figures():
    lines = repeat_warnings({"web": 1000, "code": 100}, {"web": 550, "code": 550}, max_repeats=4)
    assert lines == ["source 'code' has 100 train tokens but the mixture asks for 550: each document is "
                     "repeated 5.50 times on average, more than pack.max_repeats=4"]
    assert repeat_warnings({"web": 1000, "code": 100}, {"web": 550, "code": 550}, max_repeats=6) == []


def test_a_source_that_gets_nothing_is_a_warning_with_the_figures():
    lines = empty_warnings({"web": 990, "code": 10}, {"web": 985, "code": 0}, {"web": 5, "code": 40})
    assert lines == ["source 'code': the mixture asks for 10 train tokens, fewer than its shortest document "
                     "(40 tokens), so none of its documents is trained on; raise its weight or tokens"]
    assert empty_warnings({"web": 990, "code": 50}, {"web": 985, "code": 40}, {"web": 5, "code": 40}) == []
    # a source with no tokens to take (its documents all empty) is asked for none: nothing to warn of
    assert empty_warnings({"web": 990, "code": 0}, {"web": 985, "code": 0}, {"web": 5, "code": 0}) == []


def test_weighted_targets_are_rounded_to_the_nearest_token():
    # 11 tokens at 1:2 are 3.67 and 7.33: 4 and 7, not 3 and 7
    assert targets({"web": 5, "code": 6}, {"web": Share(weight=1), "code": Share(weight=2)}) == {"web": 4, "code": 7}


def test_exactly_max_repeats_passes_is_no_warning():
    assert repeat_warnings({"code": 100}, {"code": 400}, max_repeats=4) == []
    assert len(repeat_warnings({"code": 100}, {"code": 401}, max_repeats=4)) == 1
