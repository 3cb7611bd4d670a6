"""Corpus to packed tokens: readers, tokenizer, packing, chat data, the packed dataset (no torch import)."""
