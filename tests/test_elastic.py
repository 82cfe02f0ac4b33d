"""Elastic Horovod: a worker dies, training goes on, a new worker joins."""
import socket
import stat

import pytest

from tests.hvdrun import horovodrun, rank_lines

pytestmark = pytest.mark.horovod


def test_elastic_worker_failure_and_join(tmp_path):
    join_host = socket.gethostname()
    if join_host in ("localhost", "127.0.0.1"):
        pytest.skip("needs a host name other than localhost for the joining worker")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    result = horovodrun(
        "elastic_train.py", str(hosts), str(tmp_path), join_host, np=2, timeout=300,
        hosts=["--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover),
               "--elastic-timeout", "60"])
    out = result.stdout
    assert rank_lines(out, "KILL"), "the worker was not killed"
    assert rank_lines(out, "RESET"), "no elastic reset happened"
    starts = rank_lines(out, "START")
    assert any(f"host={join_host}" in line for line in starts), "no worker joined"
    finals = rank_lines(out, "FINAL")
    assert len(finals) == 2, out[-3000:]
    for line in finals:
        fields = dict(item.split("=") for item in line.split())
        assert fields["size"] == "2" and fields["identical"] == "True", line
        assert float(fields["last"]) < float(fields["first"]), line
    # Every survivor and the newcomer finished at the same step count (phase).
    assert len({dict(i.split("=") for i in l.split())["steps"] for l in finals}) == 1
