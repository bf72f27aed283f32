"""Text of a request's tokens as they come: incremental detokenization and stop strings.

Stop strings are matched on the detokenized text, across chunk and token boundaries; the text
ends before the stop string, and text that could still become a stop string is held back from
the stream until it cannot.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream


class TextStream:
    """One request's output text. add(token) per generated token; `ready()` is the text that may
    be streamed now; `stopped` says a stop string ended it (the text stops before it)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.sent = 0  # characters already handed out by ready()
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when it completed a stop string (the text is cut there)."""
        if self.stopped:
            return True
        piece = self._decoder.step(self._tokenizer, int(token_id))
        if not piece:
            return False
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        if self._stop:
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (not streamable yet)."""
        if self.stopped:
            return 0
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def ready(self, final: bool = False) -> str:
        """The text not yet handed out that can be streamed (all of it when final)."""
        end = len(self.text) if final else len(self.text) - self._held()
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
