"""Elastic Horovod training with hvd_acp, used by tests/test_elastic.py.

Usage: elastic_train.py HOSTS_FILE MARKER_DIR JOIN_HOST

Starts on two "hosts" (aliases of this machine). The worker on 127.0.0.1
dies at step 6; the survivor goes on alone, then adds JOIN_HOST to the
discovery file so that a fresh worker joins and must pick up the same
factors and phase. Every rank prints ``FINAL <rank> <size> <step_count>
<loss> <digest>`` at the end.
"""
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_acp

torch.set_num_threads(1)
HOSTS_FILE, MARKER_DIR, JOIN_HOST = sys.argv[1:4]
TOTAL_STEPS = 30
TEACHER = torch.randn(12, 5, generator=torch.Generator().manual_seed(99))

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   model.named_parameters(), matrix_rank=2)
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, losses=[])
host = os.environ.get("HOROVOD_HOSTNAME", "")
print(f"START host={host} rank={hvd.rank()} size={hvd.size()}", flush=True)


def on_reset():
    print(f"RESET rank={hvd.rank()} size={hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    deadline = time.time() + 120
    while state.batch < TOTAL_STEPS or hvd.size() < 2:
        if time.time() > deadline:
            raise RuntimeError("no worker joined in time")
        step = state.batch
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        x = torch.randn(16, 12, generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), (x @ TEACHER).argmax(dim=1))
        loss.backward()
        opt.step()
        marker = os.path.join(MARKER_DIR, "killed")
        if host == "127.0.0.1" and step == 6 and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"KILL rank={hvd.rank()} step={step}", flush=True)
            os._exit(1)
        if hvd.size() == 1 and step >= 10 and not os.path.exists(marker + ".joined"):
            open(marker + ".joined", "w").close()
            with open(HOSTS_FILE, "a") as f:
                f.write(f"{JOIN_HOST}:1\n")
        if hvd.size() == 1:
            time.sleep(0.2)       # give the driver time to notice the new host
        state.losses.append(loss.item())
        state.batch += 1
        state.commit()


train(state)
digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(digest.unsqueeze(0))
identical = all(torch.equal(row, gathered[0]) for row in gathered)
factors = torch.cat([f.reshape(-1) for f in opt.reducer.state.q_factors.values()])
gathered_f = hvd.allgather(factors.unsqueeze(0))
identical_factors = all(torch.equal(row, gathered_f[0]) for row in gathered_f)
losses = state.losses
print(f"FINAL rank={hvd.rank()} size={hvd.size()} steps={opt.step_count} "
      f"identical={identical and identical_factors} first={sum(losses[:5]) / 5:.4f} "
      f"last={sum(losses[-5:]) / 5:.4f}", flush=True)
