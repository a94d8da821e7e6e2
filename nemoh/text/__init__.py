"""Text on top of token ids: the checkpoint's tokenizer and chat template, streaming detokenisation,
and generate_text (a thin layer over nemoh.generate)."""

from nemoh.text.generate import encode_prompts, generate_text
from nemoh.text.stream import TextStream
from nemoh.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer", "TextStream", "encode_prompts", "generate_text"]
