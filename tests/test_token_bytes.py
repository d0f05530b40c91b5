"""A token's own bytes, as log-probabilities show it (token_bytes.py): byte-level BPE is covered through the
server in test_server.py; here SentencePiece-style tokenizers, built in memory (no shipped model has one)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from looped_spec.token_bytes import TextOffsets, TokenBytes

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "▁": 5, "Hello": 6, "<0xE6>": 7, "<0x97>": 8,
         "<0xA5>": 9}  # fmt: skip


def sentencepiece_tokenizer(decoder) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(vocab=VOCAB, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


LLAMA_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)


@pytest.mark.parametrize("decoder", [LLAMA_DECODER, decoders.Metaspace()], ids=["llama", "metaspace"])
def test_a_sentencepiece_token_keeps_its_space_and_a_byte_piece_is_its_byte(decoder):
    """Decoded alone, "▁world" is "world" (the decoder strips the text's first space) and "<0xE6>" U+FFFD: a token's
    bytes come from its piece, so the tokens' bytes make up the text after the first token, "▁Hello" and "Hello" show
    apart (they key top_logprobs), and text offsets follow the text."""
    tokenizer = sentencepiece_tokenizer(decoder)
    tokens = TokenBytes(tokenizer)
    assert tokens.raw(4) == b" world" and tokens.text(3) == " Hello" and tokens.text(6) == "Hello"
    assert tokens.text(1) == "<s>"  # a special token shows its name, as decoded
    if isinstance(decoder, decoders.Sequence):  # byte fallback: a piece that is one byte of a character
        assert [tokens.raw(t) for t in (7, 8, 9)] == [b"\xe6", b"\x97", b"\xa5"] and tokens.text(7) == "bytes:\\xe6"
    ids = [3, 4, 5, 6]
    text = tokenizer.decode(ids)  # decoded whole, as an echoed prompt: the first space is stripped
    assert text == "Hello world Hello" and tokens.raw_at_start(3) == b"Hello" and tokens.raw_at_start(6) == b"Hello"
    offsets = TextOffsets()
    starts = [offsets.advance(tokens.raw_at_start(ids[0]) if i == 0 else tokens.raw(t)) for i, t in enumerate(ids)]
    assert [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])] == ["Hello", " world", " ", "Hello"]


def test_an_echoed_sentencepiece_prompt_has_offsets_in_its_text(tmp_path):
    """Through a real server on a checkpoint with such a tokenizer: an echoed prompt's tokens and text offsets follow
    the text returned (the prompt decoded whole, its first space stripped), streamed or not, and the generated tokens
    continue the text with their spaces."""
    import shutil

    import httpx

    from looped_spec import LoopedSpecEngine
    from tests.server_utils import ServerThread

    checkpoint = tmp_path / "ouro-sp"
    shutil.copytree("tests/fixtures/ouro-tiny", checkpoint)
    sentencepiece_tokenizer(LLAMA_DECODER).save_pretrained(checkpoint)
    engine = LoopedSpecEngine(str(checkpoint), speculation="off", max_model_len=64)
    body = {"model": "m", "prompt": [3, 4], "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
            "allowed_token_ids": [3, 4]}  # fmt: skip
    with ServerThread(engine, "m") as server:
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        chunks = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60).text
    text, logprobs = whole["text"], whole["logprobs"]
    assert text.startswith("Hello world ")  # the prompt decoded whole, then the continuation with its space
    assert logprobs["tokens"][:2] == ["Hello", " world"] and set(logprobs["tokens"][2:]) <= {" Hello", " world"}
    ends = [*logprobs["text_offset"][1:], len(text)]
    assert [text[a:b] for a, b in zip(logprobs["text_offset"], ends)] == logprobs["tokens"]
    streamed = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    offsets = [
        o for c in streamed for choice in c["choices"] if choice["logprobs"] for o in choice["logprobs"]["text_offset"]
    ]
    assert offsets == logprobs["text_offset"]


def test_the_first_generated_token_keeps_its_space_offline_and_streamed(tmp_path):
    """A SentencePiece decoder strips the first space of what it decodes: the output's text is what its tokens add
    after the prompt (" Hello world", as vLLM's), not the output decoded alone ("Hello world"), and the streamed
    deltas join to it."""
    import shutil

    from looped_spec import LoopedSpecEngine, SamplingParams

    checkpoint = tmp_path / "ouro-sp"
    shutil.copytree("tests/fixtures/ouro-tiny", checkpoint)
    tokenizer = sentencepiece_tokenizer(LLAMA_DECODER)
    tokenizer.save_pretrained(checkpoint)
    engine = LoopedSpecEngine(str(checkpoint), speculation="off", max_model_len=64)
    params = SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[3, 4])
    request_id = engine.add_request([3, 4], params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out if out.finished and out.request_id == request_id else final
    expected = tokenizer.decode([3, 4, *final.token_ids])[len("Hello world") :]
    assert final.text == expected and final.text.startswith(" ") and "".join(deltas) == final.text
