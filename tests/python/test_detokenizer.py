"""IncrementalDetokenizer and stop strings, against real tokenizers trained offline at test time."""

import json
import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from octavo.engine.detokenizer import (  # noqa: E402
    IncrementalDetokenizer, check_stop_strings, streamable_text)

REPLACEMENT = "\ufffd"
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, déjà vu.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji time 😀🎉🚀 and family 👨‍👩‍👧 plus flags 🇫🇷🇯🇵 and 🤖 robots.",
    "Numbers 12345 and symbols <> {} [] #@$%^&* ~ tabs\tand\nnewlines.",
    "Straße, Ελληνικά, Русский текст, עברית, العربية.",
]
SAMPLES = CORPUS + ["  two leading spaces", "x", "😀", "a 😀b", "ends with emoji 🤖", "über"]


def _byte_level_bpe():
    """GPT-2 / Llama-3 style: byte-level pre-tokenizer and decoder; small vocab splits characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def _metaspace(byte_fallback: bool):
    """SentencePiece style: '▁' marks spaces. With byte_fallback, Llama-2's decoder and <0xXX> tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60 if byte_fallback else 1000, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    if byte_fallback:
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for byte in range(256):
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
        spec["model"]["byte_fallback"] = True
        tok = Tokenizer.from_str(json.dumps(spec))
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=False)


class ByteTokenizer:
    """A minimal non-Hugging-Face tokenizer (one id per byte, id 256 special) for the generic path."""

    all_special_ids = [256]

    def __len__(self):
        return 257

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True,
               clean_up_tokenization_spaces=False):
        out, run = [], bytearray()
        for i in ids:
            if i == 256:
                out.append(run.decode(errors="replace"))
                run = bytearray()
                if not skip_special_tokens:
                    out.append("<sp>")
            else:
                run.append(i)
        out.append(run.decode(errors="replace"))
        return "".join(out)


@pytest.fixture(scope="module")
def toks():
    return {"byte_level": _byte_level_bpe(), "metaspace": _metaspace(False),
            "byte_fallback": _metaspace(True)}


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _expected(tok, prompt, out, skip):
    """The output's text in the context of its prompt."""
    full = tok.decode(prompt + out, skip_special_tokens=skip)
    return full[len(tok.decode(prompt, skip_special_tokens=skip)):]


def _random_output(tok, rng):
    ids = []
    for _ in range(rng.randint(1, 4)):
        ids += _encode(tok, rng.choice(SAMPLES))
        if rng.random() < 0.4:
            ids.append(rng.choice(tok.all_special_ids))
    return ids


def test_tokenizers_split_characters_across_tokens(toks):
    # The invariants below only mean something if characters really are split across tokens.
    # 🦜 is not in the training corpus, so no trainer can have made it one token; the others may
    # be, depending on how the trainer breaks frequency ties (limit_alphabet).
    for name in ("byte_level", "byte_fallback"):
        tok = toks[name]
        pieces = [tok.decode([i]) for i in _encode(tok, "😀 日本語 🦜")]
        assert any(REPLACEMENT in p for p in pieces), name


@pytest.mark.parametrize("name", ["byte_level", "metaspace", "byte_fallback"])
@pytest.mark.parametrize("skip", [True, False])
def test_text_matches_decode_at_every_step(toks, name, skip):
    tok = toks[name]
    rng = random.Random(f"{name}-{skip}")
    for _ in range(40):
        prompt = _encode(tok, rng.choice(SAMPLES + [""]))
        if rng.random() < 0.3 and tok.bos_token_id is not None:
            prompt = [tok.bos_token_id] + prompt
        output = _random_output(tok, rng)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas, done = [], 0
        while done < len(output):
            size = rng.choice([1, 1, 1, 2, 3, 7])
            delta = detok.add_tokens(output[done:done + size])
            done += size
            deltas.append(delta)
            expected = _expected(tok, prompt, output[:done], skip)
            if not expected.endswith(REPLACEMENT):
                assert detok.text == expected
            assert REPLACEMENT not in delta  # the samples are valid UTF-8
        assert "".join(deltas) == detok.text
        assert detok.flush() == ""
        assert detok.text == _expected(tok, prompt, output, skip)


@pytest.mark.parametrize("name", ["byte_level", "metaspace", "byte_fallback"])
def test_without_prompt_text_equals_plain_decode(toks, name):
    tok = toks[name]
    for skip in (True, False):
        for sample in SAMPLES:
            output = _encode(tok, sample) + [tok.eos_token_id] + _encode(tok, sample)
            detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            for token in output:
                detok.add_tokens([token])
            assert detok.text == tok.decode(output, skip_special_tokens=skip)


def test_character_is_emitted_once_complete(toks):
    tok = toks["byte_level"]
    output = _encode(tok, "a😀")
    assert len(output) >= 3  # the emoji's four bytes come in several tokens
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([t]) for t in output]
    assert deltas[0] == "a"
    assert all(d == "" for d in deltas[1:-1])
    assert deltas[-1] == "😀"


def test_flush_emits_an_unfinished_character(toks):
    tok = toks["byte_level"]
    output = _encode(tok, "ok 😀")
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(output[:-1])
    assert REPLACEMENT not in detok.text and "ok".startswith(detok.text.rstrip() or "ok")
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT) and detok.text == tok.decode(output[:-1])


def test_sentencepiece_leading_space(toks):
    for name in ("metaspace", "byte_fallback"):
        tok = toks[name]
        world = _encode(tok, " world")
        # Alone, the first token's "▁" is dropped, as decode() does...
        alone = IncrementalDetokenizer(tok, [])
        alone.add_tokens(world)
        assert alone.text == tok.decode(world) == "world"
        # ... and BOS alone gives no context either ...
        after_bos = IncrementalDetokenizer(tok, [tok.bos_token_id])
        after_bos.add_tokens(world)
        assert after_bos.text == "world"
        # ... but after a prompt the output keeps its space, so prompt + output reads right.
        prompt = _encode(tok, "Hello")
        after_prompt = IncrementalDetokenizer(tok, prompt)
        after_prompt.add_tokens(world)
        assert after_prompt.text == " world"


def test_skipped_special_token_keeps_the_space_after_it(toks):
    tok = toks["metaspace"]
    hello, world = _encode(tok, "Hello"), _encode(tok, " world")
    detok = IncrementalDetokenizer(tok, [])
    for token in hello + [tok.eos_token_id] + world:
        detok.add_tokens([token])
    assert detok.text == "Hello world"
    shown = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for token in hello + [tok.eos_token_id] + world:
        shown.add_tokens([token])
    assert shown.text == tok.decode(hello + [tok.eos_token_id] + world) == "Hello</s> world"


def test_only_a_small_window_is_decoded(toks):
    tok = toks["byte_level"]
    prompt = _encode(tok, " ".join(CORPUS))
    output = _encode(tok, " ".join(CORPUS * 4))
    detok = IncrementalDetokenizer(tok, prompt)
    sizes = []
    decode = detok._decode
    detok._decode = lambda ids: sizes.append(len(ids)) or decode(ids)
    for token in output:
        detok.add_tokens([token])
    # The first step decodes the prompt context too; after it, one token of context plus the new
    # one, a few more while a character split over several tokens waits to be completed.
    assert len(output) > 300 and max(sizes[:4]) <= 26 and max(sizes[4:]) <= 12
    assert sorted(sizes)[len(sizes) // 2] <= 2
    assert detok.text == _expected(tok, prompt, output, True)


def test_random_token_ids_byte_level(toks):
    # Arbitrary ids make invalid UTF-8; with a byte-level decoder the result still matches exactly.
    tok = toks["byte_level"]
    rng = random.Random(7)
    for _ in range(60):
        output = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=rng.random() < 0.5)
        done = 0
        while done < len(output):
            size = rng.choice([1, 2, 4])
            detok.add_tokens(output[done:done + size])
            done += size
        detok.flush()
        assert detok.text == tok.decode(output, skip_special_tokens=detok.skip_special_tokens)


def test_generic_tokenizer_without_backend():
    tok = ByteTokenizer()
    output = tok.encode("naïve ") + [256] + tok.encode("日本😀")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, tok.encode("prompt é"), skip_special_tokens=skip)
        deltas = [detok.add_tokens([t]) for t in output]
        assert REPLACEMENT not in "".join(deltas)
        assert detok.text == tok.decode(output, skip_special_tokens=skip)


# ---- stop strings ----

def test_stop_string_at_the_end():
    assert check_stop_strings("Hello STOP", 4, ["STOP"], False) == ("Hello ", "STOP")
    assert check_stop_strings("Hello STOP", 4, ["STOP"], True) == ("Hello STOP", "STOP")


def test_stop_string_in_the_middle_of_a_delta():
    assert check_stop_strings("abc STOP and more", 14, ["STOP"], False) == ("abc ", "STOP")
    assert check_stop_strings("abc STOP and more", 14, ["STOP"], True) == ("abc STOP", "STOP")


def test_stop_string_spanning_two_deltas():
    # "ST" arrived in the previous step, "OP!" now: the search reaches back len("STOP") - 1 chars.
    assert check_stop_strings("abc STOP!", 3, ["STOP"], False) == ("abc ", "STOP")
    assert check_stop_strings("abc STOP!", 3, ["STOP"], True) == ("abc STOP", "STOP")


def test_stop_string_already_checked_is_not_matched_again():
    # "STOP" ended before the new characters: an earlier step would have stopped there.
    assert check_stop_strings("STOP and then", 4, ["STOP"], False) == ("STOP and then", None)


def test_no_match_and_no_new_text():
    assert check_stop_strings("hello", 5, ["bye"], False) == ("hello", None)
    assert check_stop_strings("hello", 0, ["hello"], False) == ("hello", None)
    assert check_stop_strings("hello", 3, [], False) == ("hello", None)


def test_earliest_stop_string_wins():
    text = "one two three"
    assert check_stop_strings(text, len(text), ["three", "two"], False) == ("one ", "two")
    assert check_stop_strings(text, len(text), ["three", "two"], True) == ("one two", "two")
    # Ending at the same place, the longer one (it starts earlier) wins.
    assert check_stop_strings(text, len(text), ["ee", "three"], False) == ("one two ", "three")
    # A shorter stop string inside a longer one completes first.
    assert check_stop_strings("xabcd", 5, ["abcd", "ab"], False) == ("x", "ab")


def test_streaming_with_stop_strings_through_the_detokenizer(toks):
    tok = toks["byte_level"]
    text = "Café 😀 crème STOP brûlée END"
    for stop, include in ((["STOP"], False), (["STOP"], True), (["END", "crème ST"], False)):
        hold_back = 0 if include else max(map(len, stop)) - 1
        for chunk in (1, 2, 3):
            output = _encode(tok, text)
            detok = IncrementalDetokenizer(tok, [])
            streamed, matched, done = "", None, 0
            while done < len(output) and matched is None:
                delta = detok.add_tokens(output[done:done + chunk])
                done += chunk
                final, matched = check_stop_strings(detok.text, len(delta), stop, include)
                finished = matched is not None or done >= len(output)
                streamed += streamable_text(final, len(streamed), hold_back, finished)
                if not include:
                    assert not any(s in streamed for s in stop)
            expected_stop = "crème ST" if "crème ST" in stop else "STOP"
            assert matched == expected_stop
            cut = text.index(expected_stop) + (len(expected_stop) if include else 0)
            assert streamed == text[:cut]


def test_streamable_text_holds_back():
    assert streamable_text("abcdef", 0, 3, False) == "abc"
    assert streamable_text("abcdef", 3, 3, False) == ""
    assert streamable_text("abcdef", 3, 3, True) == "def"
    assert streamable_text("ab", 0, 3, False) == ""
