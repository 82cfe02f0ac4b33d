"""The benchmark of hvd_acp: the methods of :mod:`hvd_acp.methods` side by side.

Run from the checkout: ``python -m benchmarks --help``. It is not installed
with hvd_acp; it depends on hvd_acp (its methods, models and command-line
units), never the reverse. Modules:

- :mod:`.jobs`: every job it runs: the floor, the methods, the diagnostics;
- :mod:`.stats`: ``--methods``, statistics: rounds, intervals, verdicts (pure);
- :mod:`.worker`: one rank of one job (training loop, counters);
- :mod:`.netem`: the emulated network (namespaces, veths, bridge, tbf);
- :mod:`.rendezvous`: Horovod's Gloo rendezvous for hand-launched ranks;
- :mod:`.launch`: running a job's processes with a timeout;
- :mod:`.driver`: one job per method and round, then the outputs;
- :mod:`.report`: paired ratios, results.md and breakdown.png;
- :mod:`.check`: ``python -m benchmarks check OLD NEW``, two runs compared;
- :mod:`.calibrate_link`: ``python -m benchmarks calibrate-link``, the emulated
  network's CPU cost per byte for the planner.
"""
