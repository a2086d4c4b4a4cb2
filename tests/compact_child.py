"""Child for test_compaction: compacts ROOT and SIGKILLs itself at POINT.

Usage: python compact_child.py ROOT POINT   (POINT: files, pieces, marker or retire)
"""

from __future__ import annotations

import os
import signal
import sys

from ledger.compaction import compact


def main() -> None:
    root, point = sys.argv[1], sys.argv[2]

    def hook(at: str) -> None:
        if at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    compact(root, target_rows=40, hook=hook)


if __name__ == "__main__":
    main()
