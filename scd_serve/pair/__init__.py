"""The embedded producer/consumer pair: synthetic QA language, tokenizer, training."""
