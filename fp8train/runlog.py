"""Rank-0 console output mirrored into <output_dir>/train.log, secrets redacted from both (see
fp8train/secrets.py)."""
from __future__ import annotations

import sys
import time

from .redaction import redact, secret_values


class RunLog:
    def __init__(self, is_main: bool):
        self.is_main = is_main
        self._file = None
        self._secrets = secret_values()   # read once: every line is checked against them

    def open(self, path: str) -> None:
        if self.is_main:  # the trainer has created and checked the directory
            self._file = open(path, "a", buffering=1, encoding="utf-8")

    def _write_file(self, msg: str) -> None:
        if self._file is not None:
            try:
                self._file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
            except OSError as e:   # disk full: the console still has everything
                self._file = None
                print(f"WARNING: cannot write train.log any more ({e.strerror or e}); "
                      "console only from here", file=sys.stderr, flush=True)

    def info(self, msg: str) -> None:
        if self.is_main:
            msg = redact(msg, self._secrets)
            print(msg, flush=True)
            self._write_file(msg)

    def warn(self, msg: str) -> None:
        if self.is_main:
            msg = redact(msg, self._secrets)
            print(f"WARNING: {msg}", file=sys.stderr, flush=True)
            self._write_file(f"WARNING: {msg}")

    def file_only(self, msg: str) -> None:
        self._write_file(redact(msg, self._secrets))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
