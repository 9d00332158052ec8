"""GRPO on a tiny transformer whose LM head is vocab-parallel (torch tensor parallelism, DTensor).

What it shows, end to end, the way an RL framework uses the op:

* a decoder-only transformer in plain torch (``--layers`` pre-LN blocks,
  vocabulary ``--vocab``), its LM head split along the vocabulary over
  ``--tp`` gloo ranks with ``parallelize_module`` +
  ``ColwiseParallel(use_local_output=False)``: the loss receives the logits as
  a DTensor ``[N, L, V]`` sharded ``Shard(-1)``, and never gathers them;
* rollouts: ``--prompts`` random prompts, ``--group`` responses each,
  sampled with temperature ``--temperature`` and top-p ``--top-p``; the
  sampler records which tokens it kept (the keep mask, replayed in training);
* reward: the fraction of response tokens that are multiples of 8 (1/8 of
  the vocabulary, spread over every rank's shard), which a policy learns in a
  few dozen steps;
* the GRPO loss: group-normalised advantages, the PPO-clipped ratio against
  the rollout policy's log-probs (``--epochs`` updates per rollout, so the
  ratio leaves 1 and clipping acts), minus ``--entropy-coef`` times the
  entropy; log-prob and entropy come from ``dualvp_torch.logprob_entropy`` on
  the DTensor logits, with the keep mask and the temperature;
* an audit every ``--audit-every`` steps: the micro-batch's full logits,
  targets, keep mask and the upstream gradients of the loss are handed to
  ``dualvp_jax`` (an independent implementation, vocab sharded over ``--tp``
  JAX host devices) and to the float64 NumPy oracle; the worst differences of
  log-prob, entropy and logits gradient are printed and checked against
  ``dualvp.testing.TOLERANCES``. The gradient is compared at unit upstream
  scale (both sides divided by the largest upstream gradient), so that the
  tiny ``1/tokens`` factor of a mean loss cannot hide an error.

Run::

    python examples/grpo_tiny.py                       # 2 gloo ranks, 40 steps, bench-results/grpo_tiny.png
    python examples/grpo_tiny.py --plot docs/example.png   # the README's chart (a tracked file: when asked)
    python examples/grpo_tiny.py --steps 20 --plot /tmp/x.png --json /tmp/x.json

It spawns its own ``--tp`` CPU ranks (``dualvp_torch.testing.run_ranks``).
Note that the GRPO loss itself is ~0 at the first update of every rollout by
construction (the advantages are normalised to mean 0 in each group); the
learning curve is the reward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The JAX audit shards the vocabulary over host devices like the torch ranks
# do; XLA reads this once, at import, in each process.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

_REWARD_MOD = 8


# --- the model ------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN causal self-attention + MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Decoder-only LM: ``tokens [N, S] -> logits [N, S - start, V]`` (positions ``start..S-1``)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, start: int = 0):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        # Only the positions whose logits are needed go through the LM head.
        return self.lm_head(self.ln_f(x[:, start:]))


# --- sampling -----------------------------------------------------------------


def top_p_sample(logits, temperature: float, top_p: float, gen):
    """Sample from softmax(logits / tau) restricted to the top-p nucleus.

    Returns ``(tokens [N], keep [N, V] bool)``: the nucleus is the smallest
    set of most likely tokens whose probability reaches ``top_p``.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sp, idx = probs.sort(dim=-1, descending=True)
    before = sp.cumsum(-1) - sp  # mass strictly above each token
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    p = torch.where(keep, probs, 0.0)
    tokens = torch.multinomial(p / p.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
    return tokens, keep


@torch.no_grad()
def rollout(model, prompts, args, gen, rank):
    """Generate ``args.length`` tokens per prompt row; identical on every rank (rank 0 samples).

    Returns ``(sequences [N, P + L], keep [N, L, V] bool)``.
    """
    seq = prompts
    keeps = []
    for _ in range(args.length):
        logits = model(seq, start=seq.shape[1] - 1)[:, -1]  # DTensor [N, V], Shard(-1)
        full = logits.full_tensor()  # tiny model: the sampler sees the whole row
        if rank == 0:
            tok, keep = top_p_sample(full, args.temperature, args.top_p, gen)
        else:
            tok = torch.empty(full.shape[0], dtype=torch.int64)
            keep = torch.empty(full.shape, dtype=torch.bool)
        dist.broadcast(tok, 0)
        k8 = keep.to(torch.uint8)
        dist.broadcast(k8, 0)
        seq = torch.cat([seq, tok[:, None]], dim=1)
        keeps.append(k8.bool())
    return seq, torch.stack(keeps, dim=1)


def reward_fn(responses):
    """``[N, L] -> [N]``: fraction of tokens that are multiples of 8."""
    return (responses % _REWARD_MOD == 0).float().mean(-1)


# --- the audit -------------------------------------------------------------------


def audit(z, y, keep, lp_t, h_t, gl, gh, g_t, temperature, tp):
    """Recompute log-prob, entropy and logits gradient with dualvp_jax and the float64 oracle.

    All arrays are full (gathered) ``[N, L, V]`` / ``[N, L]`` float32 NumPy.
    Returns a dict of worst absolute differences and a pass flag against
    ``dualvp.testing.TOLERANCES['float32']``.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import dualvp_jax
    from dualvp import reference
    from dualvp.testing import metrics

    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    s = 1.0 / max(float(np.abs(gl).max()), float(np.abs(gh).max()), 1e-30)  # unit upstream scale

    def f(zz):
        return dualvp_jax.sharded_logprob_entropy(zz, jnp.asarray(y), mesh, "tp", keep_mask=jnp.asarray(keep),
                                                  temperature=temperature)

    (lp_j, h_j), vjp = jax.vjp(f, jnp.asarray(z))
    (g_j,) = vjp((jnp.asarray(gl * s, dtype=jnp.float32), jnp.asarray(gh * s, dtype=jnp.float32)))
    lp_j, h_j, g_j = (np.asarray(a, dtype=np.float64) for a in (lp_j, h_j, g_j))
    lp_r, h_r = reference.logprob_entropy(z, y, keep_mask=keep, temperature=temperature)
    g_r = reference.logprob_entropy_grad(z, y, gl * s, gh * s, keep_mask=keep, temperature=temperature)
    g_ts = g_t.astype(np.float64) * s
    tol = metrics.TOLERANCES["float32"]
    out = {}
    ok = True
    for name, t, j, r, key in (
        ("logprob", lp_t, lp_j, lp_r, "logprob"),
        ("entropy", h_t, h_j, h_r, "entropy"),
        ("grad", g_ts, g_j, g_r, "grad"),
    ):
        out[f"{name}_vs_jax"] = metrics.max_errors(t, j)[0]
        out[f"{name}_vs_f64"] = metrics.max_errors(t, r)[0]
        out[f"jax_{name}_vs_f64"] = metrics.max_errors(j, r)[0]
        # Each implementation within the table's bound of the oracle, and the
        # two within the sum of their bounds of each other.
        ok &= metrics.within_tolerance(t, r, tol[key]) and metrics.within_tolerance(j, r, tol[key])
        ok &= metrics.within_tolerance(t, j, metrics.pair_tolerance("float32", key))
    out["ok"] = bool(ok)
    return out


# --- one rank's training ------------------------------------------------------------


def train(rank: int, world: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import dualvp_torch

    torch.manual_seed(args.seed)  # same initial weights on every rank
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, max_len=args.prompt_len + args.length)
    # The LM head's weight [V, d] is split on V: rank r holds rows
    # [r*V/tp, (r+1)*V/tp) and returns its logits shard as a DTensor.
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(args.seed + 1)
    v_local = args.vocab // world
    history = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=gen)
        dist.broadcast(prompts, 0)
        prompts = prompts.repeat_interleave(args.group, dim=0)  # [N = prompts * group, P]
        seq, keep_full = rollout(model, prompts, args, gen, rank)
        responses = seq[:, args.prompt_len:]
        reward = reward_fn(responses)
        r = reward.view(args.prompts, args.group)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)  # [N, 1]
        # This rank's shard of the sampler's keep mask, as a DTensor like the logits.
        keep = DTensor.from_local(keep_full[..., rank * v_local:(rank + 1) * v_local].contiguous(), mesh,
                                  [Shard(2)], run_check=False)

        def policy(grad: bool):
            logits = model(seq[:, :-1], start=args.prompt_len - 1)  # DTensor [N, L, V], Shard(-1)
            lp, h = dualvp_torch.logprob_entropy(logits, responses, keep_mask=keep, temperature=args.temperature,
                                                 entropy_grad=grad)
            return logits, lp.to_local(), h.to_local()  # replicated over tp: every rank holds all rows

        with torch.no_grad():
            _, old_lp, _ = policy(False)

        audit_now = args.audit_every > 0 and (step % args.audit_every == 0 or step == 1)
        for epoch in range(args.epochs):
            logits, lp, h = policy(True)
            ratio = torch.exp(lp - old_lp)
            pg = -torch.minimum(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
            pg_loss = pg.mean()
            ent = h.mean()
            loss = pg_loss - args.entropy_coef * ent
            opt.zero_grad(set_to_none=True)
            aud = None
            if audit_now and epoch == args.epochs - 1:
                # The same numbers the op saw and produced: gathered logits,
                # the loss's upstream gradients for log-prob and entropy, and
                # the op's logits gradient.
                gl, gh, gz = torch.autograd.grad(loss, [lp, h, logits], retain_graph=True)
                z_full, g_full = logits.detach().full_tensor(), gz.full_tensor()
                if rank == 0:
                    aud = audit(z_full.numpy(), responses.numpy(), keep_full.numpy(), lp.detach().numpy(),
                                h.detach().numpy(), gl.numpy(), gh.numpy(), g_full.numpy(), args.temperature,
                                world)
            loss.backward()
            opt.step()
            if epoch == 0:
                first = float(loss.detach())
        clipfrac = float(((ratio - 1).abs() > args.clip).float().mean())
        rec = {
            "step": step,
            "reward": float(reward.mean()),
            "loss": float(loss.detach()),
            "loss_first_epoch": first,
            "pg_loss": float(pg_loss.detach()),
            "entropy": float(ent.detach()),
            "logprob": float(lp.detach().mean()),
            "clipfrac": clipfrac,
            "seconds": time.perf_counter() - t0,
        }
        if aud is not None:
            rec["audit"] = aud
        history.append(rec)
        if rank == 0:
            line = (f"step {step:3d}  reward {rec['reward']:.3f}  loss {rec['loss']:+.4f}  "
                    f"entropy {rec['entropy']:.3f}  logprob {rec['logprob']:+.3f}  clip {clipfrac:.2f}  "
                    f"{rec['seconds']:.2f}s")
            if aud is not None:
                line += (f"  | audit vs dualvp_jax: lp {aud['logprob_vs_jax']:.1e} H {aud['entropy_vs_jax']:.1e} "
                         f"grad {aud['grad_vs_jax']:.1e}; vs float64: lp {aud['logprob_vs_f64']:.1e} "
                         f"H {aud['entropy_vs_f64']:.1e} grad {aud['grad_vs_f64']:.1e} "
                         f"{'ok' if aud['ok'] else 'OUT OF TOLERANCE'}")
            print(line, flush=True)
    return {"history": history if rank == 0 else None, "seconds": time.perf_counter() - t_start}


# --- the plot, the command ----------------------------------------------------------


def plot(history, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.6))
    ax[0].plot(steps, [h["reward"] for h in history], color="tab:green")
    ax[0].axhline(1 / _REWARD_MOD, color="gray", lw=0.8, ls=":", label="uniform policy")
    ax[0].set(title="reward (fraction of multiples of 8)", xlabel="step", ylim=(0, 1.02))
    ax[0].legend(loc="lower right", fontsize=8)
    ax[1].plot(steps, [h["entropy"] for h in history], color="tab:blue", label="entropy (nats)")
    ax[1].plot(steps, [-h["logprob"] for h in history], color="tab:orange", label="-log-prob of sampled tokens")
    ax[1].set(title="dualvp_torch outputs", xlabel="step")
    ax[1].legend(fontsize=8)
    aud = [(h["step"], h["audit"]) for h in history if "audit" in h]
    for key, label, m in (("logprob_vs_jax", "log-prob", "o"), ("entropy_vs_jax", "entropy", "s"),
                          ("grad_vs_jax", "logits grad (unit scale)", "^")):
        ax[2].semilogy([s for s, _ in aud], [max(a[key], 1e-12) for _, a in aud], m + "-", label=label)
    from dualvp.testing import metrics

    atol = min(t.atol for t in metrics.TOLERANCES["float32"].values())
    ax[2].axhline(atol, color="red", lw=0.8, ls="--", label=f"tolerance floor (atol {atol:g}, float32)")
    ax[2].set(title="audit: max |torch - dualvp_jax|", xlabel="step")
    ax[2].legend(fontsize=8)
    ax[3].plot(steps, [h["loss"] for h in history], color="tab:red", label="last update of each rollout")
    ax[3].plot(steps, [h["loss_first_epoch"] for h in history], color="tab:gray", lw=0.8,
               label="first update (ratio 1: advantage term 0)")
    ax[3].set(title=f"loss: clipped PG - {args.entropy_coef:g} * entropy", xlabel="step")
    ax[3].legend(fontsize=8)
    fig.suptitle(f"GRPO, tiny transformer (V={args.vocab}, {args.layers} layers), LM head vocab-parallel over "
                 f"{args.tp} gloo ranks (DTensor), temperature {args.temperature}, top-p {args.top_p}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel (vocab) ranks, gloo on CPU")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="responses per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--length", type=int, default=8, help="response tokens")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=2, help="updates per rollout")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--audit-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join("bench-results", "grpo_tiny.png"),
                   help="where to write the chart (default bench-results/grpo_tiny.png, ignored by git; the "
                   "README's chart: --plot docs/example.png; '' for none)")
    p.add_argument("--json", default="", help="also write the per-step history here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by --tp {args.tp}")
    from dualvp_torch.testing import run_ranks

    t0 = time.perf_counter()
    res = run_ranks(train, args.tp, args, timeout=1800)
    history = res[0]["history"]
    audits = [h["audit"] for h in history if "audit" in h]
    first, last = history[: max(1, len(history) // 5)], history[-max(1, len(history) // 5):]
    r0 = sum(h["reward"] for h in first) / len(first)
    r1 = sum(h["reward"] for h in last) / len(last)
    print(f"reward {r0:.3f} (first {len(first)} steps) -> {r1:.3f} (last {len(last)} steps); "
          f"{len(audits)} audits, worst |torch - dualvp_jax|: "
          f"log-prob {max(a['logprob_vs_jax'] for a in audits):.1e}, "
          f"entropy {max(a['entropy_vs_jax'] for a in audits):.1e}, "
          f"logits grad {max(a['grad_vs_jax'] for a in audits):.1e} (unit upstream scale); "
          f"all within dualvp.testing.TOLERANCES: {all(a['ok'] for a in audits)}; "
          f"{time.perf_counter() - t0:.0f} s" if audits else f"reward {r0:.3f} -> {r1:.3f}")
    if args.plot:
        plot(history, args.plot, args)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "history": history}, f, indent=1)
    return 0 if all(a["ok"] for a in audits) else 1


if __name__ == "__main__":
    sys.exit(main())
