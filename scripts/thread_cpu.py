"""Where a benchmark's ranks spend their CPU: each thread's user and system time.

``record`` samples ``/proc/<pid>/task/<tid>/stat`` of every process whose
command line contains ``--match`` (default: the benchmark's workers) once a
second until interrupted, one JSON line per sample; ``summarize`` prints,
for each process, each busy thread's share of a core over the later part of
the process's life (its timed steps; ``--skip`` is the share of the life
left out), user and system apart::

    .venv/bin/python scripts/thread_cpu.py record /tmp/threads.jsonl &
    .venv/bin/python -m benchmarks --model bert-base --optimizer adamw --batch-size 8 \\
        --bandwidth 200mbit --methods powersgd,ssgd-fp16 --rounds 1 --out /tmp/run
    kill %1
    .venv/bin/python scripts/thread_cpu.py summarize /tmp/threads.jsonl

A training thread that waits for the network should not use a core; one
that shows a core's worth of system time is spinning.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def _threads(match: str) -> Dict[str, Tuple[float, float]]:
    """{"pid/tid": (user s, system s)} of the matching processes' threads."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if match not in cmdline or "thread_cpu.py" in cmdline:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                found[f"{pid}/{tid}"] = (int(fields[11]) / tick, int(fields[12]) / tick)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue                      # a process or thread that just ended
    return found


def record(out: Path, match: str, every_s: float) -> None:
    with out.open("w") as sink:
        while True:
            sample = _threads(match)
            if sample:
                sink.write(json.dumps({"t": time.time(), "threads": sample}) + "\n")
                sink.flush()
            time.sleep(every_s)


def summarize(path: Path, skip: float, least: float) -> List[str]:
    by_pid: Dict[str, List[Tuple[float, str, Tuple[float, float]]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        for key, times in sample["threads"].items():
            pid, tid = key.split("/")
            by_pid[pid].append((sample["t"], tid, tuple(times)))
    lines = []
    for pid, rows in by_pid.items():
        times = sorted({t for t, _, _ in rows})
        if len(times) < 3:
            continue
        begin = times[0] + skip * (times[-1] - times[0])
        wall = times[-1] - begin
        first: Dict[str, Tuple[float, float]] = {}
        last: Dict[str, Tuple[float, float]] = {}
        for t, tid, cpu in rows:
            if t >= begin:
                first.setdefault(tid, cpu)
                last[tid] = cpu
        shares = []
        for tid in last:
            user, system = (last[tid][i] - first[tid][i] for i in (0, 1))
            if user + system >= least * wall:
                shares.append((user + system, user, system, tid))
        shares.sort(reverse=True)
        parts = [f"{'main' if tid == pid else 'thread ' + tid}: {(u + s_) / wall:.2f} "
                 f"(user {u / wall:.2f}, system {s_ / wall:.2f})"
                 for _, u, s_, tid in shares]
        lines.append(f"process {pid}, {times[-1] - times[0]:.0f} s sampled, last {wall:.0f} s: "
                     + "; ".join(parts))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample the threads' CPU times until interrupted")
    rec.add_argument("out", type=Path)
    rec.add_argument("--match", default="benchmarks.worker",
                     help="a string in the processes' command lines")
    rec.add_argument("--every-s", type=float, default=1.0)
    summ = sub.add_parser("summarize", help="each process's busy threads, shares of a core")
    summ.add_argument("samples", type=Path)
    summ.add_argument("--skip", type=float, default=0.4,
                      help="share of each process's sampled life left out (its start-up)")
    summ.add_argument("--least", type=float, default=0.01,
                      help="threads below this share of a core are not listed")
    args = parser.parse_args(argv)
    if args.command == "record":
        try:
            record(args.out, args.match, args.every_s)
        except KeyboardInterrupt:
            pass
        return 0
    print("\n".join(summarize(args.samples, args.skip, args.least)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
