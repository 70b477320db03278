"""Tables and figures, as every tool prints and draws them.

- `format_table`: columns padded to their widest cell, the first left-aligned, the rest right.
- `pyplot`: matplotlib's pyplot drawing to files only; `save_figure` writes and closes a
  figure. Both raise `kvpush.args.UsageError` naming the fix (a missing matplotlib, a
  --plot path that cannot be written).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpush.args import UsageError


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first column left, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files only, or a UsageError that names the fix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvpush[bench]'") from None
    return plt


def save_figure(plt: Any, fig: Any, path: str) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise UsageError(f"cannot write --plot {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
