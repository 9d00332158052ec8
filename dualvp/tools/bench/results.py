"""The results file of ``dualvp bench``: one CSV per device class, one row per implementation and case per run.

Every run appends to ``bench-results/<cpu|cuda>.csv`` (ignored by git)
unless ``--results`` names another file: the tracked
``benchmarks/results/<cpu|cuda>.csv`` only when asked for by name (a run
worth keeping); the header is written when the file is new. The
columns (:data:`COLUMNS`) say where and with what each row was measured
(``date``, ``commit``, ``device``, ``versions``), what (``impl``, ``op``,
``dtype``, ``mode``, ``T``, ``V_local``, ``H``, ``W``), how fast
(``wall_ms`` ... ``floor_ms``, ``tflops``; :mod:`.timing` says how each is
measured), and how exact (``err_*``: max abs error against float64 from the
rounded inputs). An empty cell is a figure that does not apply or was not
measured (kernel time and launches on a CPU, the entropy of a baseline
without one). ``note``: why a row has no figures: ``error: ...`` (the
implementation raised; the run went on) or ``skipped: ...``; empty on a
measured row. A file written before ``note`` existed gets the column added
to its header on the next append (its old rows read it as empty).
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
import sys
from typing import Iterable, Optional

__all__ = ["COLUMNS", "default_path", "environment", "append", "read", "markdown"]

COLUMNS = (
    "date", "commit", "device", "versions", "impl", "op", "dtype", "mode", "T", "V_local", "H", "W",
    "wall_ms", "fwd_ms", "bwd_ms", "kernel_ms", "queued_ms", "host_us", "launches", "first_ms", "peak_extra_B",
    "floor_ms", "tflops", "err_logprob", "err_entropy", "err_grad", "err_dh", "err_dW", "reps", "note",
)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


DEFAULT_DIR = "bench-results"  # ignored by git: a run writes no tracked file unless asked to


def default_path(device: str) -> str:
    """``bench-results/<cpu|cuda>.csv`` under the current directory (ignored by git; the tracked
    ``benchmarks/results/<cpu|cuda>.csv`` is written only when ``--results`` names it)."""
    return os.path.join(DEFAULT_DIR, f"{'cuda' if device == 'cuda' else 'cpu'}.csv")


def _commit() -> str:
    for cwd in (os.getcwd(), _ROOT):
        try:
            p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                               timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip()
    return "unknown"


def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    """``date``, ``commit``, ``device`` and ``versions`` of this run (the same on each of its rows)."""
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
    else:
        name = f"{_cpu_model()} ({os.cpu_count()} CPUs)"
    vers = [f"python {platform.python_version()}"] + [
        f"{d} {v}" for d in ("torch", "jax", "triton", "dualvp", "liger-kernel", "cut-cross-entropy")
        if (v := _version(d)) is not None]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "device": name, "versions": "; ".join(vers)}


def _cell(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def append(path: str, rows: Iterable[dict]) -> int:
    """Append ``rows`` (dicts keyed by :data:`COLUMNS`; missing keys are empty cells) to ``path``."""
    rows = list(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        _widen_header(path)
    with open(path, "a", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if new:
            w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_cell(r.get(c)) for c in COLUMNS])
    return len(rows)


def _widen_header(path: str) -> None:
    """A file whose header is an older, shorter prefix of :data:`COLUMNS` gets the new columns
    appended to its header line (its rows are left as they are: shorter rows read as empty)."""
    with open(path, newline="") as f:
        first = f.readline()
    head = next(csv.reader([first]))
    if head == list(COLUMNS) or head != list(COLUMNS[: len(head)]):
        return
    with open(path, newline="") as f:
        rest = f.read()[len(first):]
    ending = "\r\n" if first.endswith("\r\n") else "\n"
    with open(path, "w", newline="") as f:
        f.write(",".join(COLUMNS) + ending + rest)


def read(path: str) -> list[dict]:
    """The rows of a results file, as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def markdown(rows: list[dict], commit: Optional[str] = None) -> str:
    """A Markdown table of the rows of one commit (default: the last row's), one line per row."""
    if not rows:
        return "(no rows)"
    commit = commit or rows[-1]["commit"]
    rows = [r for r in rows if r["commit"] == commit]
    cols = ("impl", "op", "dtype", "mode", "T", "V_local", "H", "W", "wall_ms", "kernel_ms", "host_us", "launches",
            "peak_extra_B", "floor_ms", "tflops", "err_logprob", "err_entropy", "err_grad", "err_dh", "err_dW", "note")
    cols = [c for c in cols if any(r.get(c) for r in rows)]
    head = f"{rows[0]['device']}; {rows[0]['versions']}; commit {commit}\n\n"
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(r.get(c) or "-" for c in cols) + " |" for r in rows]
    return head + "\n".join(out)


if __name__ == "__main__":  # python -m dualvp.tools.bench.results FILE.csv [COMMIT]
    print(markdown(read(sys.argv[1]), *(sys.argv[2:3])))
