"""Training-time test (TTT): the drafter unrolled K steps on its own
outputs, scored against the target, as a draft chain is served.

Alignment (SGLang's draft extend, SpecForge's offline training): at position t
the drafter takes the target's aux states h_t and the embedding of token
x_{t+1}, and must predict x_{t+2}, whose distribution the target gives at
position t+1 (its final state there, through its lm_head). Step k feeds back
the drafter's own hidden state, takes x_{t+1+k}, and is scored against the
target at t+1+k (`Eagle3Drafter.step` is the served computation). Loss: soft
cross-entropy to the target distribution over the draft vocabulary, weighted
decay^k, on positions whose predicted token is a loss-masked (assistant)
token.

Metrics: acc_k (the drafter's top token equals the target's greedy token,
full vocabulary) and the simulated acceptance length tau = sum_k prod_{i<=k}
acc_i.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from tasks.train.drafter import Eagle3Drafter


def _shift(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, t + by] at t, `fill` past the end (time is dim 1)."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


@dataclass
class StepOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [K] positions where the drafter's top token = the target's
    counted: torch.Tensor  # [K] positions scored
    step_losses: torch.Tensor  # [K]


def ttt_forward(model: Eagle3Drafter, batch: dict, head_rows: torch.Tensor, *, steps: int, decay: float,
                full_head: torch.Tensor | None = None) -> StepOutput:
    """One TTT unroll over a padded batch. `head_rows` are the target lm_head
    rows of the draft vocabulary (the target distribution restricted to it);
    with `full_head`, accuracy is against the target's full-vocabulary greedy
    token, as at serving time, else against its top draft-vocab token."""
    dtype = head_rows.dtype
    ids, mask, lengths = batch["input_ids"], batch["loss_mask"], batch["lengths"]
    aux, final = batch["aux"].to(dtype), batch["final"].to(dtype)
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device)
    valid = pos[None, :] < lengths[:, None]
    with torch.no_grad():
        target_logits = final @ head_rows.T
        target_p = torch.softmax(target_logits.float(), dim=-1)
        d2t = model.draft_to_target
        target_top = (final @ full_head.T).argmax(-1) if full_head is not None else d2t[target_logits.argmax(-1)]
    hidden = model.fc(aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    loss = torch.zeros((), device=ids.device)
    correct, counted, step_losses = [], [], []
    for k in range(steps):
        j = k + 1
        hidden = model.step(_shift(ids, j), hidden, (pos + k)[None].expand(b, n), keys, values, valid)
        logits = model.logits(hidden)
        weight = _shift(mask, j + 1, False) & ((pos + j + 1)[None, :] < lengths[:, None])
        ce = -(_shift(target_p, j) * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        count = weight.sum()
        step_loss = (ce * weight).sum() / count.clamp(min=1)
        loss = loss + decay ** k * step_loss
        with torch.no_grad():
            hit = (d2t[logits.argmax(-1)] == _shift(target_top, j)) & weight
        correct.append(hit.sum())
        counted.append(count)
        step_losses.append(step_loss.detach())
    return StepOutput(loss, torch.stack(correct), torch.stack(counted), torch.stack(step_losses))


class TTT(torch.nn.Module):
    """`ttt_forward` as a module's forward, so DDP (which syncs gradients only
    for calls through its own forward) can wrap it."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict, head_rows: torch.Tensor, steps: int, decay: float) -> StepOutput:
        return ttt_forward(self.drafter, batch, head_rows, steps=steps, decay=decay)


def acceptance_length(acc: Iterable[float]) -> float:
    """tau = sum_k prod_{i<=k} acc_i."""
    tau, run = 0.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
