"""What the benchmarks share: the machine's load written beside a result, and where a step's time went.

The benchmarks run as scripts (`python bench/bench_x.py`), so this folder is on their path.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import subprocess
from pathlib import Path


def load() -> str:
    """`uptime`'s line (load averages), to judge how quiet the machine was; 'unknown' without it."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def top_functions(profile: cProfile.Profile, n: int = 10) -> list[str]:
    """The n functions with the most own time in a profile, one line each."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:n]
    lines = []
    for (filename, line, name), (calls, _, own, cumulative, _) in rows:
        where = "/".join(Path(filename).parts[-2:]) if filename != "~" else ""
        lines.append(f"{own * 1000:7.2f} ms own {cumulative * 1000:7.2f} ms cum {calls:5d} calls  "
                     f"{where}:{line}({name})")
    return lines
