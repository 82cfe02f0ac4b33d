"""Benchmarks of hvd_acp: S-SGD vs Power-SGD vs ACP-SGD side by side.

Run ``python -m hvd_acp.bench --help`` (or ``hvd-acp-bench``). Outside the
core: this package depends on hvd_acp, never the reverse. Modules:

- :mod:`.stats`: argument parsing and statistics: rounds, intervals, verdicts (pure);
- :mod:`.models`: models and synthetic batches;
- :mod:`.worker`: one rank of one job (training loop, counters);
- :mod:`.netem`: the emulated network (namespaces, veths, bridge, tbf);
- :mod:`.rendezvous`: Horovod's Gloo rendezvous for hand-launched ranks;
- :mod:`.launch`: running a job's processes with a timeout;
- :mod:`.driver`: one job per method and round, then the outputs;
- :mod:`.report`: paired ratios, results.md and breakdown.png;
- :mod:`.check`: ``hvd-acp-bench check OLD NEW``, two runs compared.
"""
