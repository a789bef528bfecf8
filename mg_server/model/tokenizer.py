"""Rebuild SmolLM2's byte-level BPE tokenizer from GGUF metadata.

transformers' own GGUF conversion builds a SentencePiece-style tokenizer for this file, whose
round trip fails (generation through it is garbage). The GGUF says what the real one is:
`tokenizer.ggml.model = gpt2` (byte-level BPE), `tokenizer.ggml.pre = smollm` (digits split one
by one, then GPT-2 byte-level splitting without a prefix space), token types 3 = control tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers import AddedToken

CONTROL_TOKEN_TYPE = 3  # llama.cpp's token type for control (special) tokens


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """meta: the GGUF key/values (`tokenizer.ggml.*`) as Python values."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r}")
    if meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError(f"unsupported GGUF pre-tokenizer {meta.get('tokenizer.ggml.pre')!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")

    unk = tokens[meta["tokenizer.ggml.unknown_token_id"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),  # "smollm": one digit a piece
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok
