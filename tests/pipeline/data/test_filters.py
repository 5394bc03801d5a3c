import random
from collections import Counter

import pytest

from pipeline.data.filters import FILTERS, FiltersSection, Text, dup_ngram_char_frac, first_failure, ngrams

# Lines of plausible, non-repetitive code: the shape of the default corpus.
CODE = "\n".join(
    f"def handler_{i}(request, value_{i}):\n    result = compute(value_{i}, offset={i})\n    return result + {i}"
    for i in range(8)
)


def only(name: str, **params) -> list:
    """The enabled-filter list with just ``name`` switched on (with ``params``)."""
    section = {n: {"enabled": False} for n in FILTERS}
    section[name] = {"enabled": True, **params}
    return FiltersSection.model_validate(section).enabled()


def fires(name: str, text: str, **params) -> bool:
    hit = first_failure(text, only(name, **params))
    assert hit is None or hit[0] == name
    return hit is not None


def words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 8))) for _ in range(n)]


# (filter, params, text that must fire, text that must not)
CASES = [
    ("too_short", {"min_chars": 10}, "tiny", "long enough to keep"),
    ("too_short", {"min_chars": 1, "min_words": 5}, "only four words here", "exactly five words are here"),
    ("too_long", {"max_chars": 10}, "x" * 11, "x" * 10),
    ("too_long", {"max_words": 3}, "one two three four", "one two three"),
    ("c4_lorem_ipsum", {}, "Lorem Ipsum dolor sit amet", "lorem is not enough"),
    ("c4_curly_braces", {}, "d = {1: 2}", "d = dict(a=1)"),
    ("c4_javascript", {}, "Please enable JavaScript.\nThanks.", "javascript here\n" + "plain line\n" * 19),
    ("c4_policy", {}, "This site uses cookies.\nRead our Privacy Policy.\nHello.", "A line about cookies.\nHello."),
    ("gopher_mean_word_length", {}, "a b c d e f g", "these words have ordinary lengths"),
    ("gopher_mean_word_length", {}, " ".join(["x" * 20] * 5), "these words have ordinary lengths"),
    ("gopher_symbol_ratio", {}, "# a # b # c", "#" * 80 + "\nimport os  # the operating system module here"),
    ("gopher_bullet_lines", {}, "- one\n- two\n* three\n\u2022 four", "- one\nplain line\nanother line"),
    ("gopher_ellipsis_lines", {}, "wait...\nand\u2026\nok", "one...\ntwo\nthree\nfour"),
    ("gopher_alpha_words", {}, "1 + 2 == 3 and", "alpha beta gamma delta 42"),
    ("gopher_stop_words", {}, "import os\nos.getcwd()", "the cat and the dog"),
    ("c4_terminal_punct", {}, "no ending\nnone here\nok.", "A sentence.\nAnother one!\nWhy?"),
    ("c4_min_words_per_line", {}, "a\nb\nc d e", "three words here\nand three more\nx"),
    ("gopher_dup_lines", {}, "x = 1\n" * 5 + "y = 2", CODE),
    ("gopher_dup_paragraphs", {}, "para one\n\npara one\n\npara one\n\nunique para", "a b\n\nc d\n\ne f"),
    ("gopher_top_ngrams", {}, "foo bar " * 10 + " ".join(words(20)), " ".join(words(60))),
    ("gopher_dup_ngrams", {}, " ".join(words(10) * 3), " ".join(words(200))),
]


@pytest.mark.parametrize("name,params,bad,good", CASES, ids=[c[0] for c in CASES])
def test_filter_fires_and_passes(name, params, bad, good):
    assert fires(name, bad, **params)
    assert not fires(name, good, **params)


def test_every_filter_has_a_case():
    assert {c[0] for c in CASES} == set(FILTERS)


@pytest.mark.parametrize("name,params,bad,good", CASES, ids=[c[0] for c in CASES])
def test_enabled_false_switches_a_filter_off(name, params, bad, good):
    section = {n: {"enabled": False} for n in FILTERS}
    section[name] = {"enabled": False, **params}
    enabled = FiltersSection.model_validate(section).enabled()
    assert enabled == []
    assert first_failure(bad, enabled) is None


def test_filters_run_in_registry_order_and_first_wins():
    section = FiltersSection.model_validate({"too_short": {"min_chars": 100}, "c4_lorem_ipsum": {"enabled": True}})
    assert [n for n, _, _ in section.enabled()] == [n for n in FILTERS if getattr(section, n).enabled]
    reason, detail = first_failure("lorem ipsum", section.enabled())
    assert reason == "too_short" and "11 < 100" in detail


def test_default_filters_keep_ordinary_code():
    # Prose rules are off by default, so plain code must pass every enabled filter.
    assert first_failure(CODE, FiltersSection().enabled()) is None


def _naive_dup_frac(ws: list[str], n: int) -> float:
    covered = [False] * len(ws)
    seen = set()
    for i, g in enumerate(ngrams(ws, n)):
        if g in seen:
            covered[i:i + n] = [True] * n
        seen.add(g)
    total = sum(map(len, ws))
    return sum(len(w) for w, c in zip(ws, covered) if c) / total


def test_dup_ngram_char_frac_matches_a_naive_count():
    rng = random.Random(1)
    vocab = words(6, seed=2)
    for _ in range(200):
        ws = [rng.choice(vocab) for _ in range(rng.randint(5, 60))]
        lengths = list(map(len, ws))
        for n in (1, 2, 3, 5):
            if len(ws) >= n:
                got = dup_ngram_char_frac(ws, lengths, sum(lengths), n)
                assert got == pytest.approx(_naive_dup_frac(ws, n))


def test_dup_ngrams_early_exit_agrees_with_checking_every_n():
    rng = random.Random(3)
    limits = {5: 0.30, 6: 0.28, 7: 0.26, 8: 0.24, 9: 0.22, 10: 0.20}
    check = FILTERS["gopher_dup_ngrams"].check
    cfg = FILTERS["gopher_dup_ngrams"].config(max_char_frac=limits)
    vocab = words(12, seed=4)
    for _ in range(200):
        ws = [rng.choice(vocab) for _ in range(rng.randint(10, 80))]
        lengths = list(map(len, ws))
        expect = any(dup_ngram_char_frac(ws, lengths, sum(lengths), n) > lim for n, lim in limits.items())
        assert (check(Text(" ".join(ws)), cfg) is not None) == expect


def test_top_ngram_counts_the_most_frequent_one():
    doc = Text("ab cd ab cd ab cd xy zw")
    (gram, count), = Counter(ngrams(doc.words, 2)).most_common(1)
    assert gram == ("ab", "cd") and count == 3
    detail = FILTERS["gopher_top_ngrams"].check(doc, FILTERS["gopher_top_ngrams"].config(max_char_frac={2: 0.5}))
    assert detail == "top_2gram_char_frac 0.750 > 0.5"  # 4 chars x 3 / 16 word chars


def test_bad_filter_params_are_rejected():
    with pytest.raises(ValueError, match="min=5.0 must not exceed max=4.0"):
        FiltersSection.model_validate({"gopher_mean_word_length": {"min": 5, "max": 4}})
    with pytest.raises(ValueError, match="n-gram size 0"):
        FiltersSection.model_validate({"gopher_dup_ngrams": {"max_char_frac": {0: 0.1}}})
    with pytest.raises(ValueError, match="extra"):
        FiltersSection.model_validate({"gopher_dup_lines": {"max_fracs": 0.1}})
    with pytest.raises(ValueError, match=r"single lower-case words; these never match: \['The', 'of the'\]"):
        FiltersSection.model_validate({"gopher_stop_words": {"words": ["The", "of the", "and"]}})
    with pytest.raises(ValueError, match="at least 1 item"):
        FiltersSection.model_validate({"gopher_stop_words": {"words": []}})
    for name in ("gopher_top_ngrams", "gopher_dup_ngrams"):  # on, with no n-gram size, it would check nothing
        with pytest.raises(ValueError, match=rf"{name}\.max_char_frac\n.*at least 1 item"):
            FiltersSection.model_validate({name: {"max_char_frac": {}}})
    with pytest.raises(ValueError, match="n-gram size 65 must be in"):
        FiltersSection.model_validate({"gopher_top_ngrams": {"max_char_frac": {65: 0.1}}})
    with pytest.raises(ValueError, match=r"limit 1.5 for n=2 must be in \[0, 1\]"):
        FiltersSection.model_validate({"gopher_dup_ngrams": {"max_char_frac": {2: 1.5}}})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        FiltersSection.model_validate({"c4_min_words_per_line": {"min_words": 0}})
    with pytest.raises(ValueError, match="less than or equal to 1"):
        FiltersSection.model_validate({"c4_policy": {"max_line_frac": 1.5}})
    # a range of one value is a range
    assert FiltersSection.model_validate({"gopher_mean_word_length": {"min": 4, "max": 4}})



def test_length_limits_that_leave_no_document_are_rejected():
    with pytest.raises(ValueError, match="too_short.min_words=100 exceeds too_long.max_words=50: every document"):
        FiltersSection.model_validate({"too_short": {"min_words": 100}, "too_long": {"max_words": 50}})
    with pytest.raises(ValueError, match="too_short.min_chars=11 exceeds too_long.max_chars=10: every document"):
        FiltersSection.model_validate({"too_short": {"min_chars": 11}, "too_long": {"max_chars": 10}})
    # a window of one length keeps the documents of that length; with either filter off there is no window
    assert FiltersSection.model_validate({"too_short": {"min_chars": 10}, "too_long": {"max_chars": 10}})
    off = {"enabled": False}
    assert FiltersSection.model_validate({"too_short": {"min_chars": 11}, "too_long": {"max_chars": 10, **off}})
    assert FiltersSection.model_validate({"too_short": {"min_words": 11, **off}, "too_long": {"max_words": 10}})

# (filter, params, text exactly at the limit, which the filter keeps, and one just past it, which it drops)
AT_AND_PAST_LIMIT = [
    ("too_short", {"min_chars": 4}, "abcd", "abc"),
    ("too_short", {"min_words": 3}, "a b c", "a b"),
    ("too_long", {"max_chars": 4}, "abcd", "abcde"),
    ("too_long", {"max_words": 2}, "a b", "a b c"),
    ("c4_javascript", {}, "javascript\n" + "line\n" * 9, "javascript\n" * 2 + "line\n" * 8),  # 1 of 10, 2 of 10
    ("c4_policy", {}, "uses cookies\n" + "line\n" * 9, "uses cookies\n" * 2 + "line\n" * 8),
    ("gopher_mean_word_length", {}, "abc def", "ab cd"),  # mean 3.0, 2.0
    ("gopher_mean_word_length", {}, "x" * 15, "x" * 16),  # mean 15.0, 16.0
    ("gopher_symbol_ratio", {}, "# aa bb cc", "# aa bb"),  # 1 per 4 words: 0.25; 1 per 3
    ("gopher_bullet_lines", {}, "- one\n" * 9 + "plain line", "- one\n" * 10),
    ("gopher_ellipsis_lines", {}, "a...\n" * 3 + "b\n" * 7, "a...\n" * 4 + "b\n" * 6),  # 0.3, 0.4
    ("gopher_alpha_words", {}, "a b c d 1", "a b c 1 2"),  # 0.8, 0.6
    ("gopher_stop_words", {}, "the cat and dog", "the cat sat down"),  # 2 stop words, 1
    ("c4_terminal_punct", {}, "A line.\nno end", "A line.\nno end\nnor here"),  # 0.5, 1/3
    ("c4_min_words_per_line", {}, "one two three\nx", "one two three\nx\ny"),  # 0.5, 1/3
    # 2 of 5 lines repeat (0.4), their 4 characters of 40; 3 of 6 (0.5)
    ("gopher_dup_lines", {}, "aa\naa\naa\n" + "b" * 15 + "\n" + "c" * 15,
     "aa\naa\naa\naa\n" + "b" * 15 + "\n" + "c" * 15),
    # one line of 3 characters repeats, 3 of 10 characters (0.3); of 4 characters, 4 of 12
    ("gopher_dup_lines", {}, "abc\nabc\nde", "abcd\nabcd\nde"),
    ("gopher_dup_paragraphs", {}, "p\n\np\n\np\n\np\n\n" + "\n\n".join("abcdefghi" + c for c in "qrstuv"),
     "p\n\np\n\np\n\np\n\np\n\n" + "\n\n".join("abcdefghi" + c for c in "qrstu")),  # 3 of 10 repeat; 4 of 10
    # the most frequent 2-gram: 2 x 4 of 40 word characters (0.2); 3 x 4 of 40
    ("gopher_top_ngrams", {"max_char_frac": {2: 0.2}}, "ab cd ab cd " + "efghijklmnopqrstuvwxyzABCDEFGHIJ",
     "ab cd ab cd ab cd " + "efghijklmnopqrstuvwxyzABCDEF"),
    # one repeat of a 2-gram: 4 of 20 word characters (0.2); 4 of 16
    ("gopher_dup_ngrams", {"max_char_frac": {2: 0.2}}, "ab cd ab cd efghijklmnop", "ab cd ab cd efghijkl"),
]


@pytest.mark.parametrize("name,params,at,past", AT_AND_PAST_LIMIT, ids=[c[0] for c in AT_AND_PAST_LIMIT])
def test_a_document_at_a_limit_is_kept_and_one_past_it_dropped(name, params, at, past):
    assert not fires(name, at, **params)
    assert fires(name, past, **params)


def test_the_unicode_ellipsis_counts_as_a_symbol():
    # three words, three '\u2026': a ratio of 1.0 against the limit 0.25
    assert first_failure("wait\u2026 what\u2026 now\u2026", only("gopher_symbol_ratio")) == (
        "gopher_symbol_ratio", "symbol_word_ratio 1.000 > 0.25")


def test_dup_lines_counts_the_characters_of_the_repeats_only():
    """One 47-character line twice among ten lines: 1 of 10 lines repeats (under 0.4), but the repeat holds
    47 of the 143 characters, 0.329, above 0.3."""
    long = "result = compute_everything(alpha, beta, gamma)"
    text = "\n".join([long, "a = 1", "b = 2", long, "c = 3", "d = 4", "e = 5", "f = 6", "g = 7", "h = 8"])
    assert (len(long), len(text)) == (47, 143)
    assert first_failure(text, only("gopher_dup_lines")) == ("gopher_dup_lines", "dup_line_char_frac 0.329 > 0.3")


def test_top_ngrams_never_fires_when_no_ngram_repeats():
    # "one two" is 6 of the 11 word characters, above 0.20, but it occurs once
    assert not fires("gopher_top_ngrams", "one two three")


def test_dup_ngrams_goes_on_to_a_larger_n_whose_lower_limit_the_same_fraction_breaks():
    """60 distinct 4-character words, the first 20 repeated at the end: the repeat is 20 of 80 words, 0.25
    of the characters for every n up to 20. Under the limits for n = 5, 6 and 7 (0.30, 0.28, 0.26), above
    the one for n = 8 (0.24)."""
    ws = [f"w{i:03d}" for i in range(60)]
    assert first_failure(" ".join(ws + ws[:20]), only("gopher_dup_ngrams")) == (
        "gopher_dup_ngrams", "dup_8gram_char_frac 0.250 > 0.24")


def test_stop_words_are_matched_whatever_their_case():
    assert not fires("gopher_stop_words", "THE CAT AND A DOG")


def test_line_rules_count_non_blank_lines_only():
    """Blank lines between paragraphs are neither repeated lines nor lines that dilute a fraction."""
    assert Text("a\n\n  \nb   \n").lines == ["a", "b"]
    assert not fires("gopher_dup_lines", "\n\n".join(f"x{i} = {i}" for i in range(10)))
    # one line of nine non-blank mentions javascript: 0.111, above 0.1, whatever the blank lines after it
    text = "Enable JavaScript\n" + "line\n" * 8 + "\n\n"
    assert first_failure(text, only("c4_javascript")) == ("c4_javascript", "javascript_line_frac 0.111 > 0.1")


# The rules that measure a share of words, lines or n-grams: a document with none has none to share.
SHARE_RULES = [n for n in FILTERS if n not in ("too_short", "gopher_stop_words", "c4_terminal_punct",
                                               "c4_min_words_per_line")]


@pytest.mark.parametrize("name", SHARE_RULES)
@pytest.mark.parametrize("text", ["", "\n\n"])  # a chunk of a text keeps its blank edges
def test_a_document_with_no_words_passes_the_share_rules(name, text):
    """With too_short off, an empty document reaches the other filters: those that
    measure a share keep it (no division by zero, no share of 1.0)."""
    assert not fires(name, text)


def test_paragraphs_end_at_blank_lines_that_hold_whitespace_and_are_compared_stripped():
    # the last paragraph's line end is no part of it
    assert fires("gopher_dup_paragraphs", "para one\n\npara two\n\npara one\n")
    # normalisation off: blank lines that hold spaces and tabs, and an indented paragraph
    assert fires("gopher_dup_paragraphs", "para one\n  \npara two\n \t\npara one\n\n  para one")
    # lines that repeat in paragraphs that do not
    assert not fires("gopher_dup_paragraphs", "x\ny\n\nx\nz\n\nx\nw")


def test_a_bullet_is_followed_by_whitespace():
    assert not fires("gopher_bullet_lines", "*args\n-1\n\u2022x\n*kwargs")
    assert fires("gopher_bullet_lines", "* args\n- 1\n\u2022\tx\n*  kwargs")


def test_an_ellipsis_ends_a_line_whatever_whitespace_follows_it():
    # strip_trailing_whitespace off leaves it there
    assert fires("gopher_ellipsis_lines", "a...  \nb\u2026\t\nc")


def test_a_letter_of_any_script_makes_an_alpha_word():
    assert not fires("gopher_alpha_words", "\u00fcber \u00fc \u00f1 \u65e5\u672c \u00e9")
    assert fires("gopher_alpha_words", "\u00fcber 12 3.5 == 7")


def test_top_ngrams_are_checked_smallest_n_first_in_any_order_given():
    # no 3-gram repeats, which ends the search only once the 2-grams were checked
    assert fires("gopher_top_ngrams", "ab cd ab cd", max_char_frac={3: 0.9, 2: 0.2})


def test_terminal_punctuation_may_be_a_closing_quote_or_have_whitespace_after_it():
    # one line of two ends in terminal punctuation: 0.5, not below the limit
    assert not fires("c4_terminal_punct", "he said \u201cyes\u201d\nno end")
    assert not fires("c4_terminal_punct", "a sentence.  \nno end")  # strip_trailing_whitespace off


def test_dup_ngrams_stops_early_only_under_every_remaining_limit():
    """The repeat of 'a1 a2 a3' is 6 of 24 word characters (0.25) for n = 2 and 3: under the limit for 2,
    above the one for 3, so the search goes on past 2 although the limit for 4 is higher."""
    text = "a1 a2 a3 a1 a2 a3 b1 b2 b3 b4 b5 b6"
    assert first_failure(text, only("gopher_dup_ngrams", max_char_frac={2: 0.5, 3: 0.1, 4: 0.9})) == (
        "gopher_dup_ngrams", "dup_3gram_char_frac 0.250 > 0.1")


def test_an_indented_line_counts_its_words():
    assert not fires("c4_min_words_per_line", "    one two three\nx")  # 0.5 of the lines are long enough
