"""The draft vocabulary: the target ids the drafter can propose, and how
they are chosen."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DraftVocab:
    """The N target ids the drafter can propose, ascending."""
    target_ids: np.ndarray  # int64 [N]
    vocab_size: int  # the target's

    @property
    def size(self) -> int:
        return len(self.target_ids)

    @property
    def d2t(self) -> torch.Tensor:
        return torch.from_numpy(self.target_ids - np.arange(self.size)).long()

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.from_numpy(self.target_ids)] = True
        return mask

    @classmethod
    def from_counts(cls, counts: np.ndarray, size: int) -> "DraftVocab":
        """The `size` most frequent ids; ties, and ids never seen, by id, so
        the choice is deterministic."""
        size = min(size, len(counts))
        order = np.lexsort((np.arange(len(counts)), -counts))  # count desc, then id asc
        return cls(np.sort(order[:size]).astype(np.int64), len(counts))

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> "DraftVocab":
        return cls((d2t.long() + torch.arange(len(d2t))).numpy(), vocab_size)


# Target logits computed at once, at most (positions x target vocabulary):
# 2^26 fp32 values is 256 MiB, whatever the vocabulary.
_GREEDY_CHUNK = 1 << 26


def target_greedy(final: torch.Tensor, full_head: torch.Tensor) -> torch.Tensor:
    """The target's greedy token over its full vocabulary at each position of
    `final` [..., H], in chunks of positions so a 160k vocabulary at 8k
    tokens never materialises all its logits. In the head's dtype (bf16 under
    bf16 precision: it only picks an argmax)."""
    flat = final.reshape(-1, final.shape[-1]).to(full_head.dtype)
    rows = max(1, _GREEDY_CHUNK // full_head.shape[0])
    top = torch.cat([(part @ full_head.T).argmax(-1) for part in flat.split(rows)])
    return top.view(final.shape[:-1])


class GreedyCache:
    """The target's greedy token (full vocabulary) at every position of the
    samples seen so far, kept across epochs: from the second epoch on, a
    batch's are looked up instead of multiplied out of the whole lm_head
    again (positions x the target's vocabulary x H: 17% of a step at the
    demo's sizes on a CPU). Int32 on the host, up to `max_bytes`; samples past
    that are computed each time. Safe between the loader's thread (lookup)
    and the training thread (remember): single dict operations."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.rows: dict[int, torch.Tensor] = {}
        self.bytes, self.max_bytes = 0, max_bytes

    def lookup(self, indices: list[int], n: int) -> torch.Tensor | None:
        """[len(indices), n] long, right-padded with 0, if every sample is kept."""
        rows = [self.rows.get(int(i)) for i in indices]
        if any(r is None for r in rows):
            return None
        out = torch.zeros(len(rows), n, dtype=torch.long)
        for k, r in enumerate(rows):
            out[k, :len(r)] = r
        return out

    def remember(self, indices: torch.Tensor, top: torch.Tensor, lengths: torch.Tensor) -> None:
        for i, row, m in zip(indices.tolist(), top.detach().cpu(), lengths.tolist()):
            if i not in self.rows and self.bytes + 4 * m <= self.max_bytes:
                self.rows[i] = row[:m].to(torch.int32).clone()
                self.bytes += 4 * m


def count_target_tokens(samples, head: torch.Tensor, max_tokens: int | None = None, *,
                        dtype: torch.dtype = torch.float32, positions_per_matmul: int = 8192) -> np.ndarray:
    """How often each target id is the target's greedy next token at a
    loss-masked position: the tokens the drafter must be able to propose.
    `samples` yield dicts with `loss_mask` and `final_hidden_state`; the
    target's greedy token at position j (final state j through its lm_head)
    predicts token j+1, which counts if it is loss-masked. On data the target
    answered itself these are the data's own tokens; on other data they are
    not, which is why the data tokens are not counted. Stops after
    `max_tokens` counted positions (a frequency estimate needs no more).

    Runs where `head` is (the training device), in `dtype` (bf16 on an
    accelerator: a near-tie may go either way, which a frequency estimate
    does not mind), gathering `positions_per_matmul` positions across samples
    before each (chunked) matmul."""
    device = head.device
    head = head.to(dtype)
    counts = torch.zeros(head.shape[0], dtype=torch.long, device=device)
    pending: list[torch.Tensor] = []
    held = seen = 0

    def flush():
        nonlocal pending, held
        if pending:
            top = target_greedy(torch.cat(pending), head)
            counts.add_(torch.bincount(top, minlength=len(counts)))
        pending, held = [], 0

    for s in samples:
        mask = torch.as_tensor(np.asarray(s["loss_mask"]), dtype=torch.bool)[1:]
        final = s["final_hidden_state"][:-1][mask]
        if max_tokens is not None:
            final = final[:max_tokens - seen]
        if len(final):
            pending.append(final.to(device, dtype))
            held += len(final)
            seen += len(final)
        if held >= positions_per_matmul:
            flush()
        if max_tokens is not None and seen >= max_tokens:
            break
    flush()
    return counts.cpu().numpy()
