"""Numbered progress steps on a stream, for the command line and the demo."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Numbered steps on a stream (standard error): ``[2/5] tracing ... 0.4 s``."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.stream = stream

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.done += 1
        stream = self.stream
        if stream is not None:
            print(f"[{self.done}/{self.total}] {what} ...", end="", file=stream, flush=True)
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            if stream is not None:
                print(" failed", file=stream, flush=True)
            raise
        if stream is not None:
            print(f" {time.perf_counter() - start:.1f} s", file=stream, flush=True)
