"""A byte-level BPE tokenizer for the context pair, trained on its training splits.

Pre-tokenization is Qwen2's: digits split one by one, letters take one leading non-letter
(so " value" is one token), runs of spaces stay whole. Numbers are therefore spelled digit by
digit, as in Qwen2 and Llama 3, and the task's answers ("44") tokenize the same alone as after
the prompt. `tokenizer(text)` prepends <bos>, like the demo pair's tokenizer.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<pad>", "<bos>", "<eos>")
# Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen2-0.5B)
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Deterministic for the same texts in the same order (one thread of merges)."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<bos>", eos_token="<eos>")


def single_token_words(tokenizer: PreTrainedTokenizerFast, min_len: int = 3, max_len: int = 10) -> list[str]:
    """Lower-case words w for which " w" is one token, in vocabulary order (variable names)."""
    out = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if token.startswith("Ġ") and token[1:].isascii() and token[1:].isalpha() and token[1:].islower():
            if min_len <= len(token) - 1 <= max_len:
                out.append(token[1:])
    return out


def spread(texts: list[str], num_chars: int, parts: int) -> list[str]:
    """About `num_chars` characters for a tokenizer, taken from every len/parts-th text: spread
    over modules or units, not the first few."""
    out, size = [], 0
    for text in texts[:: max(1, len(texts) // parts)]:
        out.append(text[: num_chars - size])
        size += len(out[-1])
        if size >= num_chars:
            break
    return out
