"""Held-out metrics, after every epoch (and before the first): loss,
per-step accuracy and both acceptance lengths (tasks/train/ttt.py; a DFlash
drafter's per block slot: tasks/train/dflash_training.py)."""
from __future__ import annotations

import torch

from tasks.train.data import plan_batches, prefetch
from tasks.train.dflash_training import evaluate_dflash
from tasks.train.prepare import Run
from tasks.train.ttt import acceptance_length, exact_acceptance_length, ttt_forward


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Held-out loss, per-step accuracy and both taus (the product estimate
    and the exact chained one), over up to eval_max_samples."""
    if run.dflash:
        return evaluate_dflash(run)
    cfg = run.cfg
    model = run.model
    model.eval()
    idx = run.held_idx[:cfg.eval_max_samples]
    correct = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    counted = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    in_loss = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    chained = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    chain_counted = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    losses = torch.zeros(cfg.ttt_steps)
    batches = plan_batches(run.reader.num_tokens, idx, cfg.tokens_per_batch, None)
    for batch in prefetch(run.collate, batches):
        with run.autocast():
            batch = run.on_device(batch)
            out = ttt_forward(model, batch, run.head_rows, steps=cfg.ttt_steps,
                              decay=cfg.step_decay, full_head=run.full_head, loss=cfg.loss)
            run.remember(batch, out)
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        in_loss += out.in_loss.cpu()
        chained += out.chained.cpu()
        chain_counted += out.chain_counted.cpu()
        losses += out.step_losses.cpu() * out.in_loss.cpu()
    model.train()
    acc = (correct / counted.clamp(min=1)).tolist()
    step_loss = (losses / in_loss.clamp(min=1)).tolist()
    chained, chain_counted = chained.tolist(), chain_counted.tolist()
    return {
        "loss": sum(cfg.step_decay ** k * l for k, l in enumerate(step_loss)),
        "acc": acc,
        "tau": acceptance_length(acc),
        f"tau@{cfg.serve_steps}": acceptance_length(acc[:cfg.serve_steps]),
        "tau_exact": exact_acceptance_length(chained, chain_counted),
        f"tau_exact@{cfg.serve_steps}": exact_acceptance_length(chained[:cfg.serve_steps],
                                                                chain_counted[:cfg.serve_steps]),
        # Per step k: the share of starting positions whose steps 0..k all hit (the exact tau's terms).
        "chain": [c / max(1, n) for c, n in zip(chained, chain_counted)],
        "chain_counted": chain_counted,
        "heldout_tokens": int(counted[0]),
        # Scored positions whose target greedy token the draft vocabulary lacks (left out of the loss).
        "unproposable": 1 - int(in_loss[0]) / max(1, int(counted[0])),
    }


def describe(m: dict) -> str:
    """One evaluation, as a log line."""
    acc = ", ".join(f"{a:.2f}" for a in m["acc"])
    tau_s = next(k for k in m if k.startswith("tau@"))
    exact_s = tau_s.replace("tau@", "tau_exact@")
    return (f"loss {m['loss']:.3f}, tau {m['tau']:.2f} (exact {m['tau_exact']:.2f}), {tau_s} {m[tau_s]:.2f} "
            f"(exact {m[exact_s]:.2f}), acc [{acc}], {100 * m['unproposable']:.1f}% of positions unproposable")
