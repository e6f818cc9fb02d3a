"""Held-out metrics of a training run: the acceptance lengths every family
reports (a TTT step's or a DFlash block slot's accuracies), the table, the
plot, the files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


def acceptance_length(acc: Iterable[float]) -> float:
    """tau = sum_k prod_{i<=k} acc_i: exact only if the steps' hits are
    independent (they are not: a drafter that misses step 0 at a hard token
    often misses the next too)."""
    tau, run = 0.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def exact_acceptance_length(chained: Iterable[int], chain_counted: Iterable[int]) -> float:
    """sum_k P(steps 0..k all hit), each over the starting positions whose
    steps 0..k are all scored (`chain_hits`)."""
    return sum(c / max(1, n) for c, n in zip(chained, chain_counted))


def metrics_table(history: list[dict]) -> list[dict]:
    rows = []
    for m in history:
        row = {"epoch": m["epoch"], "step": m["step"], "loss": round(m["loss"], 4)}
        # The product estimate (tau, tau@S) and the exact chained one (tau_exact, tau_exact@S).
        row.update({k: round(v, 3) for k, v in m.items() if k.startswith("tau")})
        row.update({f"acc{k}": round(a, 3) for k, a in enumerate(m["acc"])})
        if m.get("served"):  # train.serve_every: SGLang's own counts for these weights
            row["served_accept_length"] = round(m["served"]["pooled"], 3)
            row.update({f"served_pos{k + 1}": round(p, 3) for k, p in enumerate(m["served"]["per_position"])})
        rows.append(row)
    return rows


def plot_metrics(history: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [m["epoch"] for m in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(epochs, [m["loss"] for m in history], marker="o")
    a.set(xlabel="epoch", ylabel="held-out TTT loss", title="loss")
    tau_s = next(k for k in history[0] if k.startswith("tau@"))
    for key, marker in (("tau", "o"), (tau_s, "s")):
        line, = b.plot(epochs, [m[key] for m in history], marker=marker, label=f"{key} (product)")
        exact = key.replace("tau", "tau_exact")
        # A run resumed from before the exact tau existed has rows without it.
        b.plot(epochs, [m.get(exact, float("nan")) for m in history], marker=marker, linestyle="--",
               color=line.get_color(), label=f"{exact} (chained)")
    served = [m for m in history if m.get("served")]
    if served:
        # Accepted drafts per verify step: SGLang's accept length less its bonus token, on tau's scale.
        b.plot([m["epoch"] for m in served], [m["served"]["pooled"] - 1 for m in served], marker="D", color="black",
               label="SGLang, accepted drafts per step")
    b.set(xlabel="epoch", ylabel="simulated acceptance length", title="held-out tau" + (
        ", and as served" if served else ""))
    b.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_metrics(out_dir: Path, history: list[dict]) -> dict:
    import pandas as pd

    csv = out_dir / "metrics.csv"
    pd.DataFrame(metrics_table(history)).to_csv(csv, index=False)
    (out_dir / "metrics.json").write_text(json.dumps(history, indent=2) + "\n")
    return {"csv": str(csv), "plot": str(plot_metrics(history, out_dir / "metrics.png"))}
