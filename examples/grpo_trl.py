"""TRL's GRPOTrainer with and without ``dualvp_torch.compat.trl.install()``, on the CPU, nothing downloaded.

A tiny randomly initialised Llama (a ``transformers`` config: 2 layers, hidden 32, a 16-word vocabulary)
is rewarded for answering "yes"; a word-level tokenizer is built in memory. The
same seeded run is trained twice, with TRL's own ``selective_log_softmax`` / ``entropy_from_logits`` and
with dualvp's (one line: ``install()``), and both loss curves are printed (with the entropy and the
gradient norm). In float32 the losses agree to 1e-5 relative (checked; the run exits 1 otherwise), and a
call counter proves that dualvp computed the trainer's log-probs and entropies. Two optimiser steps per
generation (``num_iterations=2``) make the loss depend on the log-probs: on-policy, GRPO's ratio
``exp(logp - logp.detach())`` is exactly 1 whatever they are.

Needs ``trl`` (written against TRL 1.10, whose GRPO trainer calls ``selective_log_softmax``; TRL >= 1.11
computes GRPO's log-probs in its own fused LM head instead), ``transformers``, ``accelerate`` and
``datasets``: ``pip install "trl==1.10.0"``. These are not dependencies of dualvp::

    python examples/grpo_trl.py            # --steps 4 by default
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; fail fast if something tries
os.environ.setdefault("WANDB_DISABLED", "true")
# The op's eager stages: at these toy shapes torch.compile's first-call compile (~10 s on a 2-core VM)
# would cost more than the whole run saves; the values are the same to float32 rounding.
os.environ.setdefault("DUALVP_COMPILE", "0")

WORDS = ["[PAD]", "[UNK]", "[EOS]", "yes", "no", "maybe", "is", "the", "sky", "blue", "cat", "a", "?", "ok", "dog",
         "red"]
PROMPTS = ["is the sky blue ?", "is a cat red ?", "is the dog ok ?", "is a sky a cat ?"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    fast.padding_side = "left"
    return fast


def model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=2, bos_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


def reward_yes(completions, **kwargs):
    """The fraction of "yes" among the completion's words, plus a dense term (the mean of the words'
    positions in the vocabulary, / 100) so that a group's rewards differ and the loss moves."""
    out = []
    for c in completions:
        words = c.split() or ["[UNK]"]
        ids = [WORDS.index(w) if w in WORDS else 1 for w in words]
        out.append(sum(w == "yes" for w in words) / len(words) + sum(ids) / len(ids) / 100)
    return out


def train(steps: int, seed: int, out_dir: str) -> list:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, learning_rate=3e-3, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, seed=seed, data_seed=seed, temperature=1.0, beta=0.0, disable_tqdm=True,
        dataloader_num_workers=0, bf16=False, fp16=False,
        # 2 optimiser steps per generation: the second one's ratio exp(logp - logp_old) != 1, so the loss
        # itself depends on the log-probs (on-policy, the ratio is exactly 1 whatever they are)
        num_iterations=2,
    )
    trainer = GRPOTrainer(
        model=model(seed), reward_funcs=reward_yes, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}), processing_class=tokenizer(),
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the curves are printed side by side below
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [(h["loss"], h["entropy"], h["grad_norm"]) for h in logs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import trl  # noqa: F401
    from trl import GRPOTrainer  # noqa: F401 - the trainer module is loaded before install(): it is rebound too

    from dualvp_torch.compat import trl as dualvp_trl

    t_import = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t1 = time.perf_counter()
        theirs = train(args.steps, args.seed, tmp)
        with dualvp_trl.install() as inst:  # the one line; uninstalled when the block ends
            before = dict(dualvp_trl.calls)
            ours = train(args.steps, args.seed, tmp)
            used = {k: dualvp_trl.calls[k] - before.get(k, 0) for k in dualvp_trl.calls}
        t_train = time.perf_counter() - t1
    print(f"TRL {trl.__version__}; install() patched {inst.modules}")
    print(f"dualvp calls during the second run: {used}")
    print(f"{'step':>4} {'loss (TRL)':>12} {'loss (dualvp)':>13} {'entropy (TRL)':>13} {'entropy (dualvp)':>16} "
          f"{'|grad| (TRL)':>12} {'|grad| (dualvp)':>15}")
    worst = {"loss": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    for i, (a, b) in enumerate(zip(theirs, ours), 1):
        for j, key in enumerate(worst):
            worst[key] = max(worst[key], abs(a[j] - b[j]) / max(abs(a[j]), 1e-12))
        print(f"{i:>4} {a[0]:>12.8f} {b[0]:>13.8f} {a[1]:>13.8f} {b[1]:>16.8f} {a[2]:>12.8f} {b[2]:>15.8f}")
    print("largest relative differences: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    print(f"imports {t_import:.1f} s, two runs of {args.steps} steps {t_train:.1f} s")
    ok = (len(theirs) == len(ours) == args.steps and worst["loss"] <= args.rtol
          and used.get("selective_log_softmax", 0) > 0 and used.get("entropy_from_logits", 0) > 0)
    print(f"{'OK' if ok else 'FAILED'}: float32 losses agree to {worst['loss']:.1e} relative (<= {args.rtol}); "
          f"dualvp computed the log-probs {used.get('selective_log_softmax', 0)} times and the entropies "
          f"{used.get('entropy_from_logits', 0)} times")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
