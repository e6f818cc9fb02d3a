"""Held-out metrics, after every epoch (and before the first): loss,
per-step accuracy and both acceptance lengths, as the run's family scores
them (an EAGLE-3 drafter per TTT step, tasks/train/eagle3/training.py; a
DFlash drafter per block slot, tasks/train/dflash/training.py), in the
same keys."""
from __future__ import annotations

from tasks.train.run import Run


def evaluate(run: Run) -> dict:
    """Held-out loss, per-step accuracy and both taus (the product estimate
    and the exact chained one), over up to eval_max_samples."""
    return run.family.evaluate(run)


def describe(m: dict) -> str:
    """One evaluation, as a log line."""
    acc = ", ".join(f"{a:.2f}" for a in m["acc"])
    tau_s = next(k for k in m if k.startswith("tau@"))
    exact_s = tau_s.replace("tau@", "tau_exact@")
    return (f"loss {m['loss']:.3f}, tau {m['tau']:.2f} (exact {m['tau_exact']:.2f}), {tau_s} {m[tau_s]:.2f} "
            f"(exact {m[exact_s]:.2f}), acc [{acc}], {100 * m['unproposable']:.1f}% of positions unproposable")
