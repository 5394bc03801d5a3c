import pytest

from bench.goals import goal


@pytest.mark.parametrize("value, op, target, verdict", [
    (0.85, ">=", 0.85, "met"), (0.849, ">=", 0.85, "NOT met"),
    (1.3, "<=", 1.3, "met"), (1.31, "<=", 1.3, "NOT met"),
    (1023.9, "<", 1024, "met"), (1024, "<", 1024, "NOT met"),
    (float("nan"), ">=", 0.85, "NOT met"), (float("nan"), "<=", 5, "NOT met"),
])
def test_the_verdict_is_computed_from_the_figure(value, op, target, verdict):
    assert goal(value, op, target) == f"(goal {op} {target:g}: {verdict})"


def test_an_unknown_comparison_is_refused():
    with pytest.raises(KeyError):
        goal(1.0, "=>", 1.0)
