"""Training-time test (TTT): the drafter unrolled K steps on its own
outputs, scored against the target, as a draft chain is served.

Alignment (SGLang's draft extend, SpecForge's offline training): at position t
the drafter takes the target's aux states h_t and the embedding of token
x_{t+1}, and must predict x_{t+2}, whose distribution the target gives at
position t+1 (its final state there, through its lm_head). Step k feeds back
the drafter's own hidden state, takes x_{t+1+k}, and is scored against the
target at t+1+k (`Eagle3Drafter.step` is the served computation). Loss
(`LOSSES`): soft cross-entropy to the target distribution over the draft
vocabulary (forward KL up to the target's entropy), or the total variation
between the two, whose complement is what speculative sampling accepts, or
their sum; weighted decay^k, on positions whose predicted token is a loss-masked (assistant)
token and whose target greedy token (full vocabulary) is in the draft
vocabulary (as SpecForge: the drafter cannot propose the others, and the
target distribution restricted to the draft vocabulary says nothing useful
there).

Metrics: acc_k (the drafter's top token equals the target's greedy token,
full vocabulary, over all scored positions, the excluded ones included) and
two simulated acceptance lengths: tau = sum_k prod_{i<=k} acc_i (the usual
estimate, which takes the steps' hits as independent) and the exact one,
sum_k P(steps 0..k all hit), from each starting position's own chain.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.train.eagle3.model import Eagle3Drafter
from tasks.train.vocab import target_greedy


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
    step_losses: torch.Tensor  # [K] mean loss over the positions in the loss
    in_loss: torch.Tensor  # [K] positions in the loss (scored, target greedy token in the draft vocabulary)
    chained: torch.Tensor  # [K] starting positions whose steps 0..k all hit
    chain_counted: torch.Tensor  # [K] starting positions whose steps 0..k are all scored
    hits: torch.Tensor  # [K, b, n] bool: step k of the chain starting at t hit (scored positions only)
    scored: torch.Tensor  # [K, b, n] bool: step k of the chain starting at t is scored
    target_top: torch.Tensor  # [b, n] the target's greedy token after each position, what the hits are against


LOSSES = ("forward_kl", "tv", "kl_tv")


def divergence(kind: str, target_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per position, the drafter's distribution (logits) against the
    target's (target_p), both over the draft vocabulary. `tv`: 1 - sum
    min(p, q), the probability speculative sampling rejects a draft when
    the target's mass is all in the draft vocabulary (it is renormalised
    there); greedy verification accepts by the argmax instead. Its gradient
    through the softmax is about 1/V of cross-entropy's while q is near
    uniform, so from random weights it learns slowly. `kl_tv`: their sum,
    cross-entropy's gradient early and TV's term once q is close."""
    if kind not in LOSSES:
        raise ValueError(f"loss {kind!r}: use one of {', '.join(LOSSES)}")
    logq = torch.log_softmax(logits.float(), dim=-1)
    kl = -(target_p * logq).sum(-1) if kind != "tv" else 0.0
    tv = 0.5 * (target_p - logq.exp()).abs().sum(-1) if kind != "forward_kl" else 0.0
    return kl + tv


def chain_hits(hits: list[torch.Tensor], scored: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per starting position, a running AND over the steps: (chained [K]: how
    many positions have steps 0..k all hit, chain_counted [K]: how many have
    steps 0..k all scored). hits, scored: K bool tensors of one shape."""
    alive, alive_scored = torch.ones_like(hits[0]), torch.ones_like(scored[0])
    chained, counted = [], []
    for hit, score in zip(hits, scored):
        alive_scored = alive_scored & score
        alive = alive & hit & score
        chained.append(alive.sum())
        counted.append(alive_scored.sum())
    return torch.stack(chained), torch.stack(counted)


def ttt_forward(model: Eagle3Drafter, batch: dict, head_rows: torch.Tensor, *, steps: int, decay: float,
                full_head: torch.Tensor | None = None, loss: str = "forward_kl") -> StepOutput:
    """One TTT unroll over a padded batch. `head_rows` are the target lm_head
    rows of the draft vocabulary (the target distribution restricted to it).
    With `full_head` (the target's whole lm_head), accuracy is against the
    target's full-vocabulary greedy token, as at serving time, and positions
    where that token is outside the draft vocabulary are left out of the
    loss; without it, accuracy is against the target's top draft-vocab token
    and no position is left out."""
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
        if full_head is None:
            target_top = d2t[target_logits.argmax(-1)]
        else:  # remembered from an earlier epoch (vocab.GreedyCache), or computed
            target_top = batch["target_top"] if "target_top" in batch else target_greedy(final, full_head)
        proposable = model.t2d[target_top]
    hidden = model.project(aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros((), device=ids.device)
    hits, scored, in_loss, step_losses = [], [], [], []
    for k in range(steps):
        j = k + 1
        out = model.step(_shift(ids, j), hidden, (pos + k)[None].expand(b, n), keys, values, valid)
        logits, hidden = model.readout(out)
        weight = _shift(mask, j + 1, False) & ((pos + j + 1)[None, :] < lengths[:, None])
        loss_weight = weight & _shift(proposable, j, False)
        per_position = divergence(loss, _shift(target_p, j), logits)
        count = loss_weight.sum()
        step_loss = (per_position * loss_weight).sum() / count.clamp(min=1)
        total = total + decay ** k * step_loss
        with torch.no_grad():
            hits.append((d2t[logits.argmax(-1)] == _shift(target_top, j)) & weight)
        scored.append(weight)
        in_loss.append(count)
        step_losses.append(step_loss.detach())
    chained, chain_counted = chain_hits(hits, scored)
    return StepOutput(total, torch.stack([h.sum() for h in hits]), torch.stack([s.sum() for s in scored]),
                      torch.stack(step_losses), torch.stack(in_loss), chained, chain_counted,
                      torch.stack(hits), torch.stack(scored), target_top)


class TTT(torch.nn.Module):
    """`ttt_forward` as a module's forward, so DDP (which syncs gradients only
    for calls through its own forward) can wrap it."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict, head_rows: torch.Tensor, steps: int, decay: float,
                full_head: torch.Tensor | None = None, loss: str = "forward_kl") -> StepOutput:
        return ttt_forward(self.drafter, batch, head_rows, steps=steps, decay=decay, full_head=full_head, loss=loss)
