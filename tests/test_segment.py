"""Long-form text and dialogue as segments (s2tts.frontend.segment): upstream's turn batching, sentence cuts in any
script, graphemes and speaker tags never split, the text's own whitespace kept."""

import random

import pytest
import regex

from s2tts.frontend.segment import SPEAKER_TAG, Turn, batches, nbytes, split_text, split_turns


def _grapheme_ends(text):
    return {m.end() for m in regex.finditer(r"\X", text)}


def _check_pieces(text, pieces, limit):
    assert "".join(pieces) == text  # nothing lost, whitespace kept
    pos = 0
    for p in pieces:
        assert p
        graphemes = regex.findall(r"\X", p)
        assert nbytes(p) <= limit or len(graphemes) == 1, (p, limit)
        pos += len(p)
        assert pos in _grapheme_ends(text) or pos == len(text), f"cut inside a grapheme at {pos}"


def test_dialogue_batches_as_upstream():
    text = "".join(f"<|speaker:{i % 2}|> Turn number {i}, said plainly.  " for i in range(12))
    out = batches(text, chunk_length=200)
    lines = [ln for b in out for ln in b.split("\n")]
    assert [int(SPEAKER_TAG.match(ln).group(1)) for ln in lines] == [i % 2 for i in range(12)]  # one tag a turn
    assert [ln.split("|>", 1)[1] for ln in lines] == [f"Turn number {i}, said plainly." for i in range(12)]  # stripped
    assert all(len(b.split("\n")) <= 5 and sum(nbytes(ln) for ln in b.split("\n")) <= 200 for b in out)
    assert len(out) == 3  # 12 turns of 42-43 bytes: 4 per batch by bytes (5 would pass 200)
    assert batches(text, chunk_length=10_000) == ["\n".join(lines[:5]), "\n".join(lines[5:10]), "\n".join(lines[10:])]


def test_batches_count_bytes_as_upstream():
    """Upstream's `group_turns_into_batches` adds up its turns' bytes (tags included) without the newlines that join
    them: six 90-byte turns at chunk_length=270 are 2 batches of 3 (272 bytes each with the newlines), as upstream
    cuts them; counting the newlines made 3 batches of 2."""
    turns = [f"<|speaker:{i % 2}|>" + f"Turn {i} " + "x" * (90 - 13 - len(f"Turn {i} ")) for i in range(6)]
    assert all(nbytes(t) == 90 for t in turns)
    out = batches("".join(turns), chunk_length=270)
    assert out == ["\n".join(turns[:3]), "\n".join(turns[3:])] and nbytes(out[0]) == 272
    # any dialogue of turns that fit a batch: greedy by the same two rules
    rng = random.Random(3)
    for _ in range(200):
        limit = rng.randint(40, 300)
        turns = [f"<|speaker:{rng.randint(0, 3)}|>" + "w" * rng.randint(1, limit - 13) for _ in range(rng.randint(1, 12))]
        want, group = [], []
        for t in turns:
            if group and (len(group) == 5 or sum(map(nbytes, group)) + nbytes(t) > limit):
                want.append("\n".join(group))
                group = []
            group.append(t)
        want.append("\n".join(group))
        assert batches("".join(turns), chunk_length=limit) == want


def test_text_before_the_first_tag_is_kept():
    turns = split_turns("Narrator first. <|speaker:0|>Then me.<|speaker:1|>   <|speaker:1|>And you.")
    assert turns == [Turn(None, "Narrator first."), Turn(0, "Then me."), Turn(1, "And you.")]  # empty turn dropped
    assert batches("Narrator first. <|speaker:0|>Then me.") == ["Narrator first.\n<|speaker:0|>Then me."]


def test_long_untagged_text_cuts_at_sentence_ends():
    sentences = [f"Sentence {i} has a few words in it{'!' if i % 3 == 0 else '.'}" for i in range(60)]
    text = " ".join(sentences)
    out = batches(text, chunk_length=200)
    assert all(nbytes(b) <= 200 for b in out) and len(out) > 10
    assert " ".join(out) == text  # cuts only at the spaces after sentence ends
    assert all(b[-1] in ".!" for b in out)
    _check_pieces(text, split_text(text, 200), 200)


def test_long_turn_keeps_its_voice_across_batches():
    text = "<|speaker:3|>" + " ".join(f"Part {i} of a long monologue." for i in range(40)) + "<|speaker:1|>Reply."
    out = batches(text, chunk_length=150)
    assert all(b.startswith("<|speaker:3|>Part") for b in out[:-1]) and out[-1].endswith("<|speaker:1|>Reply.")
    spoken = " ".join(SPEAKER_TAG.sub("", b.split("\n")[0]) for b in out)
    assert spoken.startswith("Part 0 of") and "Part 39 of a long monologue." in spoken


@pytest.mark.parametrize("text, marks", [
    ("今天天气很好。我们去公园吧！你觉得怎么样？" * 8, "。！？"),
    ("東京は晴れです。明日は雨でしょう。" * 10, "。"),
])
def test_cjk_cuts_after_its_punctuation(text, marks):
    pieces = split_text(text, 60)
    _check_pieces(text, pieces, 60)
    assert all(p[-1] in marks for p in pieces)


def test_text_without_spaces_or_punctuation_cuts_between_graphemes():
    text = "ก่อนหน้านี้" * 30 + "한국어텍스트" * 30  # Thai with combining marks, Hangul syllables
    pieces = split_text(text, 50)
    _check_pieces(text, pieces, 50)
    assert len(pieces) > 10


def test_graphemes_and_tags_are_never_split():
    family = "👨‍👩‍👧‍👦"  # one grapheme, 25 bytes
    accented = "e\u0301"  # e + combining acute
    text = (family + accented) * 20
    pieces = split_text(text, 30)
    _check_pieces(text, pieces, 30)
    assert all(p.count("\u200d") % 3 == 0 for p in pieces)  # every family whole
    assert split_text(family, 4) == [family]  # a grapheme bigger than the budget stays whole
    out = batches("<|speaker:12|>" + "word " * 200, chunk_length=64)
    assert all(SPEAKER_TAG.fullmatch(b[: b.index("|>") + 2]) for b in out)  # every batch starts with the whole tag


def test_whitespace_inside_a_text_is_kept():
    text = "First line,  with two spaces.\nSecond line\twith a tab. Third sentence ends here."
    pieces = split_text(text, 40)
    _check_pieces(text, pieces, 40)
    assert any("  " in p for p in pieces) and any("\t" in p for p in pieces)


def test_random_texts_round_trip():
    rng = random.Random(7)
    alphabet = ["word", " ", ". ", "!", "。", "，", "漢字", "é", "e\u0301", "👍🏽", "🇫🇷", "\n", "  ", "ñ", "ก่", "…"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120)))
        limit = rng.randint(1, 80)
        _check_pieces(text, split_text(text, limit), limit)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        batches("text", chunk_length=8)
    with pytest.raises(ValueError):
        split_text("text", 0)


def test_several_voices_combine_as_upstream():
    import numpy as np

    from s2tts.frontend.segment import combine_voices

    a, b = np.zeros((10, 3), np.int32), np.ones((10, 2), np.int32)
    text, codes = combine_voices([("First voice speaking.", a), ("<speaker:7>Second voice.", b)])
    assert text == "<|speaker:0|>First voice speaking.\n<|speaker:7|>Second voice."  # a tag given is kept
    assert codes.shape == (10, 5) and (codes[:, :3] == 0).all() and (codes[:, 3:] == 1).all()  # concatenated in time
    with pytest.raises(ValueError, match="like the others"):
        combine_voices([("A.", a), ("B.", np.ones((9, 2)))])
    with pytest.raises(ValueError, match="special token"):
        combine_voices([("A <|im_end|>", a)])


def _split_reference(text, max_bytes):
    """The first, quadratic version of split_text (every cut re-scans the whole rest): the definition it must keep."""
    import regex

    from s2tts.frontend.segment import _CLAUSE, _SENTENCE, _SPACE, nbytes

    pieces = []
    while nbytes(text) > max_bytes:
        ends = [m.end() for m in regex.finditer(r"\X", text)]
        fit = 0
        for e in ends:
            if nbytes(text[:e]) > max_bytes:
                break
            fit = e
        fit = fit or ends[0]
        cut = fit
        for pattern in (_SENTENCE, _CLAUSE, _SPACE):
            best = max((m.end() for m in pattern.finditer(text, 0, fit) if 0 < m.end() <= fit and m.end() in set(ends)),
                       default=0)
            if best:
                cut = best
                break
        pieces.append(text[:cut])
        text = text[cut:]
    return pieces + ([text] if text else [])


def test_split_text_windowed_equals_the_definition():
    """The windowed split (linear: 100,000 characters in well under a second) cuts exactly where the whole-text scan
    does, on mixed scripts, emoji sequences, combining marks, long words and no punctuation at all."""
    import random

    from s2tts.frontend.segment import split_text

    rng = random.Random(7)
    atoms = ["Hello there. ", "a, ", "word ", "naïve ", "e\u0301", "👩‍👩‍👧 ", "這是句子。", "没有标点", "한국어 ",
             "x" * 40, "!? ", "\n", "…", "—", "مرحبا ", "“quoted.” "]
    for trial in range(60):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 120)))
        for max_bytes in (1, 7, 16, 50, 200):
            got = split_text(text, max_bytes)
            assert got == _split_reference(text, max_bytes), (trial, max_bytes)
            assert "".join(got) == text
