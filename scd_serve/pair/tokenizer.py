"""The pair's tokenizer: word level, trained with the `tokenizers` library, saved in HF format.

One token per word keeps the language's key/value structure visible to a tiny model and
makes answers 2-3 tokens long. `tokenizer(text)` prepends <bos>, as the training data does.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from scd_serve.corpus import lexicon as lx


def train_tokenizer() -> PreTrainedTokenizerFast:
    """Train on the lexicon, each word once, so the vocabulary is exactly the language."""
    words = lx.lexicon().all_words
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(lx.SPECIAL_TOKENS), min_frequency=1)
    tok.train_from_iterator(iter(words), trainer=trainer)
    bos_id = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
    )
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def encode_words(tokenizer: PreTrainedTokenizerFast, words: list[str]) -> list[int]:
    """Fast path for the trainer: <bos> + one id per word (same ids as `tokenizer(text)`)."""
    vocab = tokenizer.get_vocab()
    unk = vocab["<unk>"]
    return [vocab["<bos>"]] + [vocab.get(w, unk) for w in words]
