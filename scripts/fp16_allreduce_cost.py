"""What a float16 all-reduce costs against a float32 one, in Horovod and in torch's Gloo.

The planner charges Horovod's float16 collectives extra host work per byte
(``fp16_reduce_s_per_byte``, measured by every node profile); this script
shows where that comes from, on the host it runs on, with no emulated link:
each collective library all-reduces (averages) buffers of float32 and
float16 of the same length, one after the other, and the medians per
element are compared. ::

    .venv/bin/python scripts/fp16_allreduce_cost.py --np 2 --out bench-results/fp16_allreduce

runs ``horovodrun`` and ``torchrun`` (2 ranks, 1 thread each) on this very
file and writes ``results.json`` and ``results.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _worker(library: str, numel: int, repeats: int, out: Path) -> None:
    import torch
    torch.set_num_threads(1)
    if library == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def allreduce(t):
            hvd.allreduce_(t, op=hvd.Average, name=f"cost.{t.dtype}")
        close = hvd.shutdown
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def allreduce(t):
            dist.all_reduce(t)
            t.div_(size)
        # Gloo's threads must be stopped before the interpreter exits, or
        # the process can abort ("terminate called without an active exception").
        close = dist.destroy_process_group
    bufs = {str(dt).replace("torch.", ""): torch.ones(numel, dtype=dt)
            for dt in (torch.float32, torch.float16)}
    for buf in bufs.values():
        allreduce(buf)
    times = {name: [] for name in bufs}
    for _ in range(repeats):
        for name, buf in bufs.items():
            started = time.perf_counter()
            allreduce(buf)
            times[name].append(time.perf_counter() - started)
    if rank == 0:
        out.write_text(json.dumps({"size": size, "numel": numel, "times": times}))
    close()


def _launch(library: str, np: int, numel: int, repeats: int, tmp: Path) -> dict:
    out = tmp / f"{library}.json"
    args = [str(Path(__file__).resolve()), "--worker", library, "--numel", str(numel),
            "--repeats", str(repeats), "--worker-out", str(out)]
    if library == "horovod":
        cmd = [str(BIN / "horovodrun"), "-np", str(np), sys.executable, *args]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(np), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, timeout=900, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", choices=("horovod", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.numel, args.repeats, args.worker_out)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for library in ("horovod", "torch"):
            found = _launch(library, args.np, args.numel, args.repeats, Path(tmp))
            ns = {dt: statistics.median(t) / args.numel * 1e9 for dt, t in found["times"].items()}
            rows.append({"library": library, "ns_per_element": ns,
                         "fp16_extra_ns_per_element": ns["float16"] - ns["float32"] / 2})
    names = {"horovod": "Horovod (hvd.allreduce_, op=hvd.Average; Gloo on CPU)",
             "torch": "torch.distributed (Gloo: all_reduce, then / size)"}
    lines = [f"# float16 against float32 all-reduce, {args.np} ranks on one host", "",
             f"{args.numel:,} elements a buffer, averaged over the ranks; the median of "
             f"{args.repeats} of each, one float32 then one float16 in turn; 1 thread a rank, "
             "no emulated link (loopback). The float16 extra is the float16 collective's "
             "time per element less half the float32 one's (the part that would scale with "
             "bytes).", "",
             "| library | float32 (ns/element) | float16 (ns/element) | float16 extra (ns/element) |",
             "|---|---:|---:|---:|"]
    for row in rows:
        ns = row["ns_per_element"]
        lines.append(f"| {names[row['library']]} | {ns['float32']:.2f} | {ns['float16']:.2f} | "
                     f"{row['fp16_extra_ns_per_element']:.2f} |")
    lines += ["", f"Host: {platform.machine()}, {os.cpu_count()} CPUs; python "
              f"{platform.python_version()}.", "",
              "Command: `.venv/bin/python scripts/fp16_allreduce_cost.py "
              + " ".join(a for a in (argv if argv is not None else sys.argv[1:])) + "`"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"np": args.np, "numel": args.numel, "repeats": args.repeats, "rows": rows},
            indent=1) + "\n")
        (args.out / "results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
