"""Incremental detokenisation: token ids in one at a time, text out as soon as it is final.

A token can end in the middle of a multi-byte character (byte-level BPE splits them), and decoding a
token alone can lose context (a leading space, a merge across tokens). So each step re-decodes a short
window of recent tokens and emits only the growth of the text, holding it back while it ends in an
incomplete character (decoded as U+FFFD). The pieces concatenate to the decode of all the ids.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

REPLACEMENT = "\ufffd"


@dataclasses.dataclass
class TextStream:
    """One sequence's stream. decode: ids -> text (special tokens skipped); ids: every token pushed;
    ids[prefix:read] is the context window re-decoded each step; ids[:read] have been emitted."""

    decode: Callable[[list[int]], str]
    ids: list[int] = dataclasses.field(default_factory=list)
    prefix: int = 0
    read: int = 0

    def _growth(self) -> tuple[str, str]:
        return self.decode(self.ids[self.prefix : self.read]), self.decode(self.ids[self.prefix :])

    def push(self, token: int) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token))
        before, after = self._growth()
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held back at the end of the sequence (an incomplete character as U+FFFD)."""
        before, after = self._growth()
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
