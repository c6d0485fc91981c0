"""Helpers shared by the benchmark scripts: environment banner and tables."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["banner", "fmt_ratio", "median", "render_table"]


def _first_line(argv: Sequence[str]) -> str:
    if shutil.which(argv[0]) is None:
        return f"{argv[0]}: not installed"
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, check=False, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else f"{argv[0]}: no output"


def banner(title: str, *, tools: bool = False) -> str:
    """Date, interpreter and (optionally) peer program versions, one per line."""
    lines = [
        f"# {title}",
        f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M:%SZ')}",
        f"python -V: Python {platform.python_version()} ({sys.executable})",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]
    if tools:
        lines.append(f"haproxy -v: {_first_line(['haproxy', '-v'])}")
        lines.append(f"nginx -v: {_first_line(['nginx', '-v'])}")
        lines.append(f"wrk -v: {_first_line(['wrk', '-v'])}")
        lines.append(f"iperf3 -v: {_first_line(['iperf3', '-v'])}")
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def fmt_ratio(value: float) -> str:
    """``1.23x``, or ``-`` for NaN/infinite."""
    if value != value or value in (float("inf"), float("-inf")):  # noqa: PLR0124
        return "-"
    return f"{value:.2f}x"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out.extend(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])
