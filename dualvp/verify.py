"""``dualvp verify``: every backend against the float64 oracle."""

from __future__ import annotations

import numpy as np

from . import cases, reference, simulate


def run(args) -> int:
    c = cases.Case(
        name="verify",
        lead=(args.tokens,),
        vocab=args.vocab,
        worlds=(args.tp,),
        dtype=args.dtype,
        temperature=args.temperature,
        mask=args.mask,
        logits="confident_lm",
        seed=args.seed,
    )
    prob = cases.make(c)
    kw = dict(keep_mask=prob.keep_mask, temperature=c.temperature, ignore_index=c.ignore_index)
    ref = reference.logprob_entropy(prob.logits, prob.target, **kw)
    ref_g = reference.logprob_entropy_grad(prob.logits, prob.target, prob.grad_logprob, prob.grad_entropy, **kw)
    lp, h, g = simulate.logprob_entropy_sharded(
        prob.logits, prob.target, args.tp, grad_logprob=prob.grad_logprob, grad_entropy=prob.grad_entropy,
        dtype=np.float32 if args.dtype != "float64" else np.float64, **kw
    )
    fail = False
    print(f"{'check':<18}{'quantity':<10}{'max abs':>12}{'max rel':>12}  result")
    for name, x, r in (("logprob", lp, ref[0]), ("entropy", h, ref[1]), ("grad", g, ref_g)):
        a, rel = cases.max_errors(x, r)
        ok = cases.within_tolerance(x, r, cases.tolerance(args.dtype, name))
        fail |= not ok
        print(f"{'spec vs oracle':<18}{name:<10}{a:>12.3e}{rel:>12.3e}  {'PASS' if ok else 'FAIL'}")
    return 1 if fail else 0
