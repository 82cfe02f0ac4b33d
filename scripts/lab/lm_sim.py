"""The transformer screening simulator, with the options the low-budget study added:
  {"core": K}       between P and Q steps (ACP-SGD's refreshes of one side), K - 1 steps
                    that send only the r x r core Ph^T A Qh on both bases (local residual)
  {"core_both": K}  a step of both factors (as "tangent"), then K - 1 core steps
  {"sa_v2": 1}      step-ahead under AdamW as the library computes it: v' = b2 v + (1 - b2) E^2
  {"tangent": 1, "ef_local": 1}  both factors with the local residual (the library's default)
  {"int8": kappa}   with "tangent": each worker's factors as integer levels in [-L, L],
                    L = 127 // n, on per-column steps kappa * max |last average's column| / L
                    (the library's int8_factors, kappa 2), a byte an element; the residual keeps
                    what rounding and clipping leave out; the first step sends floats
  {"int8": kappa, "adapt": [grow, shrink, low, high]}
                    each factor column's headroom (kappa at the start) moves with the number of
                    workers that clipped it on the step before (what one more 8-bit digit per
                    column in the same all-reduce would carry, identical on every worker): times
                    grow where any worker clipped it, times shrink where none did, within
                    [low, high]
  {"int8": kappa, "digit_max": D, "lane_bytes": b}
                    wider lanes: L = D // n levels a worker, b bytes an element on the wire
                    (three 10-bit lanes to an int32 word: D 511, b 4/3)
  {"int8": kappa, "own": 1}
                    the step kappa * (the workers' own column maxima of the step before,
                    averaged) / L instead of the last average's (an integer per column in
                    the same all-reduce would carry the sum)
  {"int8": kappa, "split": 1}
                    the core Ph^T A Qh (r x r) once, in fp16 (counted), and only the factors'
                    parts outside the bases, P_i - Ph C_i and Q_i - Qh C_i^T, in 8-bit levels,
                    on steps from the last average of those parts
  {"int8": kappa, "stats": 1}
                    every 50 steps, per matrix: the core's share of a factor's energy (with
                    "split"), the columns' largest element over their root mean square, and a
                    worker's column maxima over the last average's (lines "STAT", "SPIKE")
  --method tsr      the TSR-style baseline (run_tsr: core all-reduce, sketched refresh, Adam in
                    the core)
Screened (seed 0, 4 workers, 3 layers, batch 16, 300 steps, AdamW lr 1e-2, S-SGD's best of
6e-3 / 1e-2 / 1.5e-2; bytes as a share of S-SGD's fp32 with fp16 on the wire):
  python scripts/lab/lm_sim.py --seeds 0 --method acp --rank 32 --lr 1e-2 \
      --opts '{"core":2,"step_ahead":0.2,"sa_v2":1,"min_rate":1}'

[Baselines beside S-SGD, Power-SGD and ACP-SGD: --method diloco and --method demo (run_diloco/run_demo);
  diloco: --opts '{"H":30,"outer_lr":0.7,"outer_mom":0.9}'
  demo:   --lr X (sign-SGD lr for 2-D tensors) --opts '{"k":8,"chunk":64,"beta":0.999,"dct":1,"sign":1}'
          {"signum": b} control: no compression, shared momentum b of the exact mean grad, sign update]
Single-process simulation of N-worker S-SGD / Power-SGD / ACP-SGD on a byte-level
GPT (the model and recipe of scripts/user_lm.py), with AdamW or SGD.

Research harness, not part of the product: a change to the compression maths can be
tried on 2-3 seeds in about a minute per run instead of many minutes under horovodrun. Each of --n workers draws its own batch of random
windows of torch's *.py sources every step; per-worker gradients go through a
per-parameter compressor (mean for ssgd) and the averaged G goes into p.grad,
then clip_grad_norm_(clip) and the optimizer step.

Model: GPT with own attention blocks, untied token embedding (tok 256xd) and head
(256xd, no bias), learned positions (pos, seq x d), pre-LN blocks (qkv, proj, fc, out).

  python lm_sim.py --method {ssgd,powersgd,acp} --rank R [--opt adamw|sgd]
        [--seeds 0 1] [--steps 300] [--opts JSON] [--diag K]

--opts JSON (combine freely):
  {"exact": ["tok","head"]}     tensor classes sent uncompressed (tok,pos,attn,mlp,head)
  {"rank_of": {"tok":8,...}}    per-class rank override
  {"adam_scale": 1}             compress D_r A D_c, D from Adafactor row/col means of
                                AdamW exp_avg_sq (1/sqrt); residual kept unscaled
  {"adam_scale_pow": p}         exponent of the scaling (default 0.5 -> 1/sqrt(v))
  {"psgd_every": k}             a full Power-SGD step every k-th step (ACP otherwise)
  {"tangent": 1}                each step P = A Qh and Q = A^T Ph on the old bases, one
                                all-reduce of (n+m) r; G = Ph Q^T + P Qh^T - Ph Ph^T A Qh Qh^T
  {"ef_decay": x}               residual *= x after each step
  {"reset_every": k}            residual zeroed every k steps
  {"adam_eps": e}               AdamW eps
  {"min_rate": x}               compress if (n+m) r x <= n m (default 2)
  {"step_ahead": a}             gradient at w - a*lr*E_i/(sqrt(v_hat)+eps) (AdamW) or
                                w - a*lr/(1-0.9)*E_i (SGD), as the product (default there 0.2)
  {"ef_local": 1}               residual A_i - P_i Qh^T (product's local form) not A_i - G
  {"ef_local_psgd": 1}          on Power-SGD steps too: residual A_i - Ph Ph^T A_i (else A_i - G)
  {"exact_first": T}            first T steps exact (uncompressed) averaging
  {"v_freeze": T}               AdamW exp_avg_sq frozen after step T (use with exact_first)
--diag K: every K steps record, per class, relative error of G vs true mean gradient,
  plain and in Adam's metric (divide by sqrt(v_hat)+eps of the optimizer state).
"""
import argparse, json, math, os, sys, tempfile, time, zlib
from pathlib import Path
import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)

CLASSES = ("tok", "pos", "attn", "mlp", "head")


def load_corpus(limit_mb=8.0):
    root = Path(torch.__file__).parent
    cache = Path(tempfile.gettempdir()) / f"lm_sim_corpus_{limit_mb}.pt"
    if cache.exists():
        return torch.load(cache)
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    parts = {True: [], False: []}
    total = 0
    for path in files:
        data = path.read_bytes()
        parts[zlib.crc32(path.relative_to(root).as_posix().encode()) % 10 == 0].append(data)
        total += len(data)
        if total > limit_mb * 1e6:
            break
    train, val = b"\n\n".join(parts[False]), b"\n\n".join(parts[True])
    out = (torch.frombuffer(bytearray(train), dtype=torch.uint8).clone(),
           torch.frombuffer(bytearray(val), dtype=torch.uint8).clone())
    torch.save(out, cache)
    return out


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, seq_len, d, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def cls_of(name):
    if name.startswith("tok"):
        return "tok"
    if name.startswith("pos"):
        return "pos"
    if name.startswith("head"):
        return "head"
    if ".qkv." in name or ".proj." in name:
        return "attn"
    if ".fc." in name or ".out." in name:
        return "mlp"
    return "other"


def orth(x):
    return torch.linalg.qr(x, mode="reduced")[0]


class Compressor:
    def __init__(self, method, name, shape, rank, n, gen, opts):
        self.method, self.n, self.opts, self.name = method, n, opts, name
        self.cls = cls_of(name)
        self.rows = shape[0]
        self.cols = 1
        for s in shape[1:]:
            self.cols *= s
        rank = opts.get("rank_of", {}).get(self.cls, rank)
        r = min(rank, self.rows, self.cols)
        self.r = r
        self.compressed = (method != "ssgd" and len(shape) >= 2
                           and self.cls not in opts.get("exact", [])
                           and (self.rows + self.cols) * r * opts.get("min_rate", 2)
                           <= self.rows * self.cols)
        if self.compressed:
            self.Q = torch.randn(self.cols, r, generator=gen, dtype=torch.float64).float()
            self.P = torch.randn(self.rows, r, generator=gen, dtype=torch.float64).float()
            self.E = [torch.zeros(self.rows, self.cols) for _ in range(n)]
            self.phase = 0
            self.step = 0

    def floats(self, psgd_step):
        """floats this worker sends this step for this tensor"""
        if not self.compressed:
            return self.rows * self.cols
        if psgd_step:
            return (self.rows + self.cols) * self.r
        K = self.opts.get("core")
        if K:
            j = self.step % (2 * K)
            if j == 0:
                return self.rows * self.r
            if j == K:
                return self.cols * self.r
            return self.r * self.r
        return self.rows * self.r if self.phase == 0 else self.cols * self.r

    def is_psgd_step(self):
        k = self.opts.get("psgd_every")
        return self.method == "powersgd" or bool(k and self.step % k == 0)

    def reduce(self, grads, vstate=None):
        """grads: list of per-worker grads; vstate: AdamW exp_avg_sq (or None)."""
        if not self.compressed:
            return sum(grads) / self.n, self.floats(False)
        shape = grads[0].shape
        o = self.opts
        M = [g.reshape(self.rows, self.cols) for g in grads]
        A = [m + e for m, e in zip(M, self.E)]
        # optional Adam-metric scaling (identical on all workers: v is replicated)
        Dr = Dc = None
        if o.get("adam_scale") and vstate is not None:
            V = vstate.reshape(self.rows, self.cols)
            R, C = V.mean(1), V.mean(0)
            if float(R.sum()) > 0:
                pw = o.get("adam_scale_pow", 0.5)
                fl = o.get("adam_scale_floor", 1e-3)
                R = R.clamp_min(fl * float(R.mean()))
                C = C.clamp_min(fl * float(C.mean()))
                Dr, Dc = R.pow(-pw), C.pow(-pw)
                Dr, Dc = Dr / Dr.mean(), Dc / Dc.mean()
        S = [a * Dr[:, None] * Dc[None, :] for a in A] if Dr is not None else A
        psgd = self.is_psgd_step()
        fl = self.floats(psgd)
        KB = o.get("core_both")
        if KB and not psgd and self.step % KB != 0:
            Ph, Qh = orth(self.P), orth(self.Q)
            Cloc = [Ph.t() @ s @ Qh for s in S]
            C = sum(Cloc) / self.n
            G = Ph @ C @ Qh.t()
            self.E = [a - Ph @ c @ Qh.t() for a, c in zip(A, Cloc)]
            self.step += 1
            return G.reshape(shape), self.r * self.r
        if KB and not psgd:
            fl = (self.rows + self.cols) * self.r
            o = dict(o, tangent=1, ef_local=1)
        K = o.get("core")
        if K and not psgd:
            j = self.step % (2 * K)
            if j == 0:      # refresh the left basis: the ACP P step on Qh
                Qh = orth(self.Q)
                Ploc = [s @ Qh for s in S]
                P = sum(Ploc) / self.n
                Gs = P @ Qh.t()
                self.P = P
                Eloc = [a - pl @ Qh.t() for a, pl in zip(A, Ploc)]
            elif j == K:    # refresh the right basis: the ACP Q step on Ph
                Ph = orth(self.P)
                Qloc = [s.t() @ Ph for s in S]
                Qn = sum(Qloc) / self.n
                Gs = Ph @ Qn.t()
                self.Q = Qn
                Eloc = [a - Ph @ ql.t() for a, ql in zip(A, Qloc)]
            else:           # the core on both bases
                Ph, Qh = orth(self.P), orth(self.Q)
                Cloc = [Ph.t() @ s @ Qh for s in S]
                C = sum(Cloc) / self.n
                Gs = Ph @ C @ Qh.t()
                Eloc = [a - Ph @ c @ Qh.t() for a, c in zip(A, Cloc)]
                if o.get("core_commit"):   # keep P Q^T's product: P <- Ph C (rotated into the core)
                    pass
            G = Gs
            self.E = Eloc if o.get("ef_local", 1) else [a - G for a in A]
            if o.get("ef_decay") is not None:
                self.E = [e * o["ef_decay"] for e in self.E]
            self.step += 1
            return G.reshape(shape), fl
        if o.get("tangent") and o.get("int8"):
            # both factors, each worker's quantized to int8 on a scale every worker knows (the
            # last step's averaged factors' column max x kappa, over 127 // n levels so that the
            # sum cannot overflow), one byte an element; the residual keeps what was clipped
            fl = (self.rows + self.cols) * self.r
            Qh, Ph = orth(self.Q), orth(self.P)
            Ploc = [s @ Qh for s in S]
            Qloc = [s.t() @ Ph for s in S]
            split = o.get("split")
            if split:
                # the core Ph^T A Qh once, in floats; only the parts outside the bases quantized
                Cloc = [Ph.t() @ x for x in Ploc]
                Ploc = [x - Ph @ c for x, c in zip(Ploc, Cloc)]
                Qloc = [x - Qh @ c.t() for x, c in zip(Qloc, Cloc)]
                if o.get("stats") and self.step % 50 == 1:
                    pe = sum(float(x.pow(2).sum()) for x in Ploc)
                    ce = sum(float(c.pow(2).sum()) for c in Cloc)
                    print(f"STAT step={self.step} shape={self.rows}x{self.cols} core_share={ce / (ce + pe + 1e-30):.3f}", flush=True)
            if o.get("stats") and self.step % 50 == 1:
                def _ratio(xs):
                    x = torch.stack(xs)
                    return float((x.abs().amax(1) / x.pow(2).mean(1).sqrt().clamp_min(1e-30)).median())
                lp = float(torch.stack([x.abs().amax(0) for x in Ploc]).median() / self.P.abs().amax(0).median().clamp_min(1e-30))
                print(f"SPIKE step={self.step} shape={self.rows}x{self.cols} p_max/rms={_ratio(Ploc):.2f} q_max/rms={_ratio(Qloc):.2f} local/avg_max_p={lp:.2f}", flush=True)
            if o.get("own"):
                own_p = sum(x.abs().amax(0) for x in Ploc) / self.n
                own_q = sum(x.abs().amax(0) for x in Qloc) / self.n
            if self.step > 0:
                L = int(o.get("digit_max", 127)) // self.n
                kappa = float(o["int8"])
                if not hasattr(self, "hp"):
                    self.hp = torch.full((self.r,), kappa)
                    self.hq = torch.full((self.r,), kappa)
                hp, hq = (self.hp, self.hq) if o.get("adapt") else (kappa, kappa)
                if o.get("own") and hasattr(self, "own_p"):
                    # the workers' own column maxima of the step before, averaged
                    dp = (hp * self.own_p / L).clamp_min(1e-30)
                    dq = (hq * self.own_q / L).clamp_min(1e-30)
                else:
                    dp = (hp * self.P.abs().amax(0) / L).clamp_min(1e-30)
                    dq = (hq * self.Q.abs().amax(0) / L).clamp_min(1e-30)
                if o.get("adapt"):
                    grow, shrink, low, high = o["adapt"]
                    for h, loc, d in ((self.hp, Ploc, dp), (self.hq, Qloc, dq)):
                        clipped = sum(((x / d).abs() > L + 0.5).any(0).float() for x in loc)
                        h.mul_(torch.where(clipped > 0, torch.tensor(float(grow)),
                                           torch.tensor(float(shrink)))).clamp_(low, high)
                if split and hasattr(self, "Pperp"):
                    dp = (hp * self.Pperp.abs().amax(0) / L).clamp_min(1e-30)
                    dq = (hq * self.Qperp.abs().amax(0) / L).clamp_min(1e-30)
                Ploc = [(x / dp).round().clamp(-L, L) * dp for x in Ploc]
                Qloc = [(x / dq).round().clamp(-L, L) * dq for x in Qloc]
                fl = fl / 2 * float(o.get("lane_bytes", 1))
            if split:
                fl = fl + self.r * self.r
                self.Pperp, self.Qperp = sum(Ploc) / self.n, sum(Qloc) / self.n
                Ploc = [x + Ph @ c for x, c in zip(Ploc, Cloc)]
                Qloc = [x + Qh @ c.t() for x, c in zip(Qloc, Cloc)]
            if o.get("own"):
                self.own_p, self.own_q = own_p, own_q
            P, Qn = sum(Ploc) / self.n, sum(Qloc) / self.n
            Gs = Ph @ Qn.t() + P @ Qh.t() - Ph @ (Ph.t() @ P) @ Qh.t()
            self.P, self.Q = P, Qn
            self.E = [a - (Ph @ ql.t() + pl @ Qh.t() - Ph @ (Ph.t() @ pl) @ Qh.t())
                      for a, pl, ql in zip(A, Ploc, Qloc)]
            self.step += 1
            return Gs.reshape(shape), fl
        if o.get("tangent"):   # both factors against the old bases, one all-reduce
            fl = (self.rows + self.cols) * self.r
            Qh, Ph = orth(self.Q), orth(self.P)
            Sb = sum(S) / self.n
            P = Sb @ Qh
            Qn = Sb.t() @ Ph
            core = Ph.t() @ P
            Gs = Ph @ Qn.t() + P @ Qh.t() - Ph @ core @ Qh.t()
            self.P, self.Q = P, Qn
            if o.get("ef_local"):
                self.E = [a - (Ph @ (Ph.t() @ a) + (a @ Qh) @ Qh.t()
                               - Ph @ (Ph.t() @ a @ Qh) @ Qh.t()) for a in A]
                self.step += 1
                return Gs.reshape(shape), fl
        elif psgd:
            P = sum(s @ self.Q for s in S) / self.n
            Ph = orth(P)
            Qn = sum(s.t() @ Ph for s in S) / self.n
            Gs = Ph @ Qn.t()
            self.Q, self.P = Qn, Ph
            self.phase = 0   # next ACP step is a P step with Qh = orth(Qn)
        else:
            if self.phase == 0:
                Qh = orth(self.Q)
                P = sum(s @ Qh for s in S) / self.n
                Gs = P @ Qh.t()
                self.P = P
            else:
                Ph = orth(self.P)
                Qn = sum(s.t() @ Ph for s in S) / self.n
                Gs = Ph @ Qn.t()
                self.Q = Qn
            self.phase ^= 1
        G = Gs / (Dr[:, None] * Dc[None, :]) if Dr is not None else Gs
        if o.get("ef_local_psgd") and psgd and Dr is None and not o.get("tangent"):
            self.E = [a - Ph @ (Ph.t() @ a) for a in A]   # local form of a Power-SGD step
        elif o.get("ef_local") and not psgd and Dr is None and not o.get("tangent"):
            if self.phase == 1:   # just did a P step with basis Qh
                self.E = [a - (a @ Qh) @ Qh.t() for a in A]
            else:
                self.E = [a - Ph @ (Ph.t() @ a) for a in A]
        else:
            self.E = [a - G for a in A]
        if o.get("ef_decay") is not None:
            self.E = [e * o["ef_decay"] for e in self.E]
        self.step += 1
        if o.get("reset_every") and self.step % o["reset_every"] == 0:
            self.E = [torch.zeros_like(e) for e in self.E]
        return G.reshape(shape), fl


def lr_sched(args):
    def lr_at(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr_at


def make_adamw(params, args, opts, lr=None):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.wd},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=args.lr if lr is None else lr, betas=(0.9, args.beta2),
                             eps=opts.get("adam_eps", 1e-8))


def evaluate(model, args, val):
    model.eval()
    with torch.no_grad():
        starts = torch.linspace(0, len(val) - args.seq - 2, args.val_windows).long()
        chunk = torch.stack([val[s:s + args.seq + 1] for s in starts.tolist()]).long()
        tot = 0.0
        for cx in chunk.split(128):
            tot += float(F.cross_entropy(model(cx[:, :-1]).reshape(-1, 256),
                                         cx[:, 1:].reshape(-1), reduction="sum"))
    return tot / (chunk.shape[0] * args.seq)


def get_batch(train, args, gen, high):
    starts = torch.randint(0, high, (args.batch,), generator=gen)
    chunk = torch.stack([train[s:s + args.seq + 1] for s in starts.tolist()]).long()
    return chunk[:, :-1], chunk[:, 1:]


def run_diloco(args, seed, train, val):
    """DiLoCo: N replicas, each its own AdamW (same lr schedule, own clipping), H local steps,
    then one all-reduce of the deltas theta_g - theta_i; outer SGD Nesterov on theta_g."""
    import copy
    torch.manual_seed(seed)
    opts = json.loads(args.opts) if args.opts else {}
    H = int(opts.get("H", 30))
    glob_model = GPT(args.seq, args.d, args.layers, args.heads)
    gparams = list(glob_model.parameters())
    outer = torch.optim.SGD(gparams, lr=opts.get("outer_lr", 0.7), momentum=opts.get("outer_mom", 0.9),
                            nesterov=opts.get("outer_mom", 0.9) > 0)
    workers = [copy.deepcopy(glob_model) for _ in range(args.n)]
    wparams = [list(m.parameters()) for m in workers]
    opts_w = [make_adamw(ps, args, opts) for ps in wparams]
    lr_at = lr_sched(args)
    gens = [torch.Generator().manual_seed(1000 * seed + w) for w in range(args.n)]
    high = len(train) - args.seq - 1
    syncs = 0
    for step in range(args.steps):
        for w in range(args.n):
            o = opts_w[w]
            for g in o.param_groups:
                g["lr"] = args.lr * lr_at(step)
            x, y = get_batch(train, args, gens[w], high)
            workers[w].zero_grad(set_to_none=True)
            loss = F.cross_entropy(workers[w](x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(wparams[w], args.clip)
            o.step()
            if not math.isfinite(float(loss.detach())):
                return float("nan"), syncs / args.steps, {}
        if (step + 1) % H == 0 or step == args.steps - 1:
            syncs += 1
            with torch.no_grad():
                for k, gp in enumerate(gparams):
                    gp.grad = sum(gp - wp[k] for wp in wparams) / args.n
            outer.step()
            with torch.no_grad():
                for wp in wparams:
                    for a, b in zip(wp, gparams):
                        a.copy_(b)
    return evaluate(glob_model, args, val), syncs / args.steps, {}


def dct_matrix(n):
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    D = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    D[0] /= math.sqrt(2.0)
    return D.float()   # orthonormal: rows = frequencies; C = X D^T, X = C D


def run_demo(args, seed, train, val):
    """DeMo-like: per worker momentum m_i = beta m_i + g_i (worker grads clipped per worker);
    for each 2-D tensor split m_i into chunks of `chunk` elements (flattened), optional DCT-II per
    chunk, keep top-k coefficients per chunk, m_i -= sent, average the sent tensors, update
    p -= lr * sign(avg) (or lr * avg), decoupled wd on 2-D; 1-D params: exact-averaged grad -> AdamW."""
    torch.manual_seed(seed)
    opts = json.loads(args.opts) if args.opts else {}
    k, ch, beta = int(opts.get("k", 8)), int(opts.get("chunk", 64)), opts.get("beta", 0.999)
    use_dct, use_sign = opts.get("dct", 1), opts.get("sign", 1)
    model = GPT(args.seq, args.d, args.layers, args.heads)
    params = list(model.parameters())
    mats = [p for p in params if p.dim() >= 2]
    vecs = [p for p in params if p.dim() < 2]
    assert all(p.numel() % ch == 0 for p in mats)
    opt1 = make_adamw(vecs, args, opts, lr=opts.get("lr1d", 3e-3))
    base1 = opt1.param_groups[0]["lr"]
    D = dct_matrix(ch)
    mom = {id(p): [torch.zeros(p.numel() // ch, ch) for _ in range(args.n)] for p in mats}
    lr_at = lr_sched(args)
    gens = [torch.Generator().manual_seed(1000 * seed + w) for w in range(args.n)]
    high = len(train) - args.seq - 1
    total = sum(p.numel() for p in params)
    sent_floats = sum(2 * k * p.numel() // ch for p in mats) + sum(p.numel() for p in vecs)
    if opts.get("signum"):
        sent_floats = total
    for step in range(args.steps):
        f = lr_at(step)
        grads = [[] for _ in params]
        for w in range(args.n):
            x, y = get_batch(train, args, gens[w], high)
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            for j, p in enumerate(params):
                grads[j].append(p.grad.detach().clone())
        if not math.isfinite(float(loss.detach())):
            return float("nan"), sent_floats / total, {}
        with torch.no_grad():
            for j, p in enumerate(params):
                if p.dim() < 2:
                    p.grad = sum(grads[j]) / args.n
                    continue
                acc = torch.zeros(p.numel() // ch, ch)
                if opts.get("signum"):   # control: exact mean grad, shared momentum, sign (B = 1)
                    M = mom[id(p)][0]
                    M.mul_(opts["signum"]).add_(sum(grads[j]).reshape(-1, ch) / args.n)
                    acc += M
                for w in range(args.n if not opts.get("signum") else 0):
                    m = mom[id(p)][w]
                    m.mul_(beta).add_(grads[j][w].reshape(-1, ch))
                    C = m @ D.t() if use_dct else m
                    idx = C.abs().topk(k, dim=1).indices
                    Cs = torch.zeros_like(C).scatter_(1, idx, C.gather(1, idx))
                    sent = Cs @ D if use_dct else Cs
                    m.sub_(sent)
                    acc += sent
                acc /= args.n
                upd = acc.sign() if use_sign else acc
                lr = args.lr * f
                p.mul_(1 - lr * args.wd)
                p.sub_(lr * upd.reshape(p.shape))
                p.grad = None
        for g in opt1.param_groups:
            g["lr"] = base1 * f
        opt1.step()
    return evaluate(model, args, val), sent_floats / total, {}


def run_tsr(args, seed, train, val):
    """TSR-style (core all-reduce, periodic sketched refresh, Adam in the core): every 2-D tensor
    n x m keeps orthonormal bases U (n x r), V (m x r); each step the workers' cores U^T G_i V
    (r x r) are averaged and Adam (the run's betas, eps) steps in the core: W -= lr * scale *
    U (Mh / (sqrt(Sh) + eps)) V^T after W *= 1 - lr * wd. Every K steps (step 0 included) the
    same all-reduce carries the sketches G_i Omega (n x r) and G_i^T Psi (m x r) (shared Gaussian
    draws); U, V <- qr of their averages, the core moments rotated into the new bases
    (M <- R1 M R2, S <- R1^2 S R2^2). Step 0 sends only the sketches. 1-D tensors, and tensors
    whose core and sketches would not be smaller: exact average, AdamW. Clipping (clip) on the
    norm of the averaged cores and 1-D gradients.
    {"warm": 1}: the sketches on the current bases (G V, G^T U: a subspace iteration warm-started
    from the last refresh) instead of fresh Gaussian draws.
    --opts {"K": 10, "scale": 1, "rank_of": {"tok": r, ...}, "K_of": {"tok": K, ...}}"""
    torch.manual_seed(seed)
    opts = json.loads(args.opts) if args.opts else {}
    model = GPT(args.seq, args.d, args.layers, args.heads)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    K0, scale = int(opts.get("K", 10)), float(opts.get("scale", 1.0))
    b1, b2, eps = 0.9, args.beta2, opts.get("adam_eps", 1e-8)
    st = {}
    for j, (nm, p) in enumerate(named):
        if p.dim() < 2:
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        c = cls_of(nm)
        r = min(opts.get("rank_of", {}).get(c, args.rank), n, m)
        K = int(opts.get("K_of", {}).get(c, K0))
        if r * r + (n + m) * r / K >= n * m:
            continue
        st[j] = dict(n=n, m=m, r=r, K=K, U=None, V=None, M=torch.zeros(r, r), S=torch.zeros(r, r), t=0)
    exact = [j for j in range(len(params)) if j not in st]
    opt1 = make_adamw([params[j] for j in exact], args, opts)
    base1 = [g["lr"] for g in opt1.param_groups]
    lr_at = lr_sched(args)
    gens = [torch.Generator().manual_seed(1000 * seed + w) for w in range(args.n)]
    high = len(train) - args.seq - 1
    total = sum(p.numel() for p in params)
    floats = 0.0
    for step in range(args.steps):
        f = lr_at(step)
        grads = [[] for _ in params]
        for w in range(args.n):
            x, y = get_batch(train, args, gens[w], high)
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            for j, p in enumerate(params):
                grads[j].append(p.grad.detach().clone())
        if not math.isfinite(float(loss.detach())):
            return float("nan"), floats / max(1, step) / total, {}
        with torch.no_grad():
            cores, sketches = {}, {}
            for j, s in st.items():
                G = [g.reshape(s["n"], s["m"]) for g in grads[j]]
                if s["U"] is not None:
                    cores[j] = sum(s["U"].t() @ g @ s["V"] for g in G) / args.n
                    floats += s["r"] * s["r"]
                if step % s["K"] == 0:
                    gg = torch.Generator().manual_seed(7919 * step + j)
                    Om = torch.randn(s["m"], s["r"], generator=gg)
                    Ps = torch.randn(s["n"], s["r"], generator=gg)
                    if opts.get("warm") and s["U"] is not None:   # subspace iteration
                        Om, Ps = s["V"], s["U"]
                    Gm = sum(G) / args.n
                    sketches[j] = (orth(Gm @ Om), orth(Gm.t() @ Ps))
                    floats += (s["n"] + s["m"]) * s["r"]
            for j in exact:
                params[j].grad = sum(grads[j]) / args.n
                floats += params[j].numel()
            sq = sum(float(c.pow(2).sum()) for c in cores.values())
            sq += sum(float(params[j].grad.pow(2).sum()) for j in exact)
            coef = min(1.0, args.clip / (math.sqrt(sq) + 1e-6))
            for j in exact:
                params[j].grad.mul_(coef)
            lr = args.lr * f
            for j, C in cores.items():
                s, p = st[j], params[j]
                C = C * coef
                s["t"] += 1
                s["M"].mul_(b1).add_(C, alpha=1 - b1)
                s["S"].mul_(b2).addcmul_(C, C, value=1 - b2)
                Mh = s["M"] / (1 - b1 ** s["t"])
                Sh = s["S"] / (1 - b2 ** s["t"])
                upd = s["U"] @ (Mh / (Sh.sqrt() + eps)) @ s["V"].t()
                p.mul_(1 - lr * args.wd)
                p.sub_((lr * scale * upd).reshape(p.shape))
            for j, (U, V) in sketches.items():
                s = st[j]
                if s["U"] is not None:
                    R1, R2 = U.t() @ s["U"], s["V"].t() @ V
                    s["M"] = R1 @ s["M"] @ R2
                    s["S"] = (R1 * R1) @ s["S"] @ (R2 * R2)
                s["U"], s["V"] = U, V
            for j in st:
                params[j].grad = None
        for g, b in zip(opt1.param_groups, base1):
            g["lr"] = b * f
        opt1.step()
    return evaluate(model, args, val), floats / args.steps / total, {}


def run(args, seed, train, val):
    if args.method == "diloco":
        return run_diloco(args, seed, train, val)
    if args.method == "demo":
        return run_demo(args, seed, train, val)
    if args.method == "tsr":
        return run_tsr(args, seed, train, val)
    torch.manual_seed(seed)
    opts = json.loads(args.opts) if args.opts else {}
    model = GPT(args.seq, args.d, args.layers, args.heads)
    names = [nm for nm, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(seed)
    comps = [Compressor(args.method, nm, p.shape, args.rank, args.n, gen, opts)
             for nm, p in zip(names, params)]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    if args.opt == "sgd":
        groups = [{"params": decay, "weight_decay": args.wd * 1e-2},
                  {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.SGD(groups, lr=args.lr, momentum=0.9)
    else:
        groups = [{"params": decay, "weight_decay": args.wd},
                  {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2),
                                eps=opts.get("adam_eps", 1e-8))
    base = [g["lr"] for g in opt.param_groups]

    def lr_at(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    gens = [torch.Generator().manual_seed(1000 * seed + w) for w in range(args.n)]
    high = len(train) - args.seq - 1
    total_floats = 0
    diag = {}   # cls -> list of (plain, adam) ratios
    ssgd_floats = sum(p.numel() for p in params)
    t0 = time.time()
    for step in range(args.steps):
        for g, b in zip(opt.param_groups, base):
            g["lr"] = b * lr_at(step)
        grads = [[] for _ in params]
        for w in range(args.n):
            starts = torch.randint(0, high, (args.batch,), generator=gens[w])
            chunk = torch.stack([train[s:s + args.seq + 1] for s in starts.tolist()]).long()
            x, y = chunk[:, :-1], chunk[:, 1:]
            sa = opts.get("step_ahead")
            shifts = []
            if sa and step > opts.get("exact_first", 0):
                with torch.no_grad():
                    lr_t = opt.param_groups[0]["lr"]
                    for p, c in zip(params, comps):
                        if not c.compressed:
                            continue
                        e = c.E[w].reshape(p.shape)
                        if args.opt == "adamw":
                            st = opt.state[p]
                            t = float(st["step"])
                            if opts.get("sa_v2"):    # the product's: v' = b2 v + (1 - b2) E^2
                                v2 = args.beta2 * st["exp_avg_sq"] + (1 - args.beta2) * e * e
                                vh = v2 / (1 - args.beta2 ** (t + 1))
                            else:
                                vh = st["exp_avg_sq"] / (1 - args.beta2 ** t)
                            d = sa * lr_t * e / (vh.sqrt() + opts.get("adam_eps", 1e-8))
                        else:
                            d = sa * lr_t / (1 - 0.9) * e
                        p.sub_(d); shifts.append((p, d))
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            with torch.no_grad():
                for p, d in shifts:
                    p.add_(d)
            for k, p in enumerate(params):
                grads[k].append(p.grad.detach().clone())
        do_diag = args.diag and step % args.diag == 0 and step > 0
        acc = {}
        with torch.no_grad():
            for k, (p, c) in enumerate(zip(params, comps)):
                st = opt.state.get(p, {})
                v = st.get("exp_avg_sq") if args.opt == "adamw" else None
                if step < opts.get("exact_first", 0):
                    G, fl = sum(grads[k]) / args.n, p.numel()
                else:
                    G, fl = c.reduce(grads[k], v)
                total_floats += fl
                if do_diag and args.opt == "adamw" and v is not None and c.cls in CLASSES:
                    Gt = sum(grads[k]) / args.n
                    t = float(st["step"])
                    vh = v / (1 - args.beta2 ** t)
                    wgt = 1.0 / (vh.sqrt() + opts.get("adam_eps", 1e-8))
                    a = acc.setdefault(c.cls, [0.0] * 7)
                    a[0] += float((G - Gt).pow(2).sum()); a[1] += float(Gt.pow(2).sum())
                    a[2] += float(((G - Gt) * wgt).pow(2).sum()); a[3] += float((Gt * wgt).pow(2).sum())
                    a[4] += float(G.pow(2).sum()); a[5] += float(vh.sqrt().sum()); a[6] += vh.numel()
                p.grad = G
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        if do_diag and args.opt == "adamw":
            with torch.no_grad():
                for p, c in zip(params, comps):
                    if c.cls not in acc:
                        continue
                    st = opt.state[p]
                    t = float(st["step"])
                    u = (st["exp_avg"] / (1 - 0.9 ** t)) / ((st["exp_avg_sq"] / (1 - args.beta2 ** t)).sqrt()
                                                         + opts.get("adam_eps", 1e-8))
                    a = acc[c.cls]
                    a.append(float(u.pow(2).sum()))
        for cl, a in acc.items():
            diag.setdefault(cl, []).append((math.sqrt(a[0] / a[1]), math.sqrt(a[2] / a[3]),
                                            math.sqrt(a[4] / a[1]), a[5] / a[6],
                                            math.sqrt(sum(a[7:]) / a[6])))
        vf = opts.get("v_freeze")
        if vf and args.opt == "adamw":
            if step == vf - 1:
                frozen = {p: opt.state[p]["exp_avg_sq"].clone() for p in params}
            elif step >= vf:
                for p in params:
                    opt.state[p]["exp_avg_sq"].copy_(frozen[p])
        if not math.isfinite(float(loss.detach())):
            return float("nan"), total_floats / args.steps / ssgd_floats, diag
    model.eval()
    with torch.no_grad():
        starts = torch.linspace(0, len(val) - args.seq - 2, args.val_windows).long()
        chunk = torch.stack([val[s:s + args.seq + 1] for s in starts.tolist()]).long()
        tot = 0.0
        for cx in chunk.split(128):
            tot += float(F.cross_entropy(model(cx[:, :-1]).reshape(-1, 256),
                                         cx[:, 1:].reshape(-1), reduction="sum"))
        vl = tot / (chunk.shape[0] * args.seq)
    return vl, total_floats / args.steps / ssgd_floats, diag


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="acp")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--opt", default="adamw")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--val-windows", type=int, default=1024)
    ap.add_argument("--opts", default="")
    ap.add_argument("--diag", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    train, val = load_corpus()
    t = time.time()
    res = []
    diags = []
    for sd in args.seeds:
        vl, frac, dg = run(args, sd, train, val)
        res.append(vl)
        diags.append(dg)
    mean = sum(res) / len(res)
    n_params = sum(p.numel() for p in GPT(args.seq, args.d, args.layers, args.heads).parameters())
    line = (f"RESULT tag={args.tag or '-'} opt={args.opt} method={args.method} r={args.rank} "
            f"opts={args.opts or '-'} L={args.layers} d={args.d} b={args.batch} steps={args.steps} "
            f"lr={args.lr} bytes_frac={frac:.4f} bytes_per_step_per_worker={frac * n_params * 4:.0f} val={[round(v, 4) for v in res]} "
            f"mean={mean:.4f} ({time.time() - t:.0f}s)")
    print(line, flush=True)
    if args.diag:
        for cl in CLASSES:
            rows = [x for dg in diags for x in dg.get(cl, [])]
            if rows:
                pl, ad, nr, sv, ur = (sum(r[i] for r in rows) / len(rows) for i in range(5))
                print(f"DIAG tag={args.tag or '-'} m={args.method} r={args.rank} lr={args.lr} opts={args.opts or '-'} cls={cl} plain_relerr={pl:.3f} adam_relerr={ad:.3f} "
                      f"normG/normGtrue={nr:.3f} mean_sqrt_vhat={sv:.3e} adam_update_rms={ur:.3f} n={len(rows)}", flush=True)
