"""Training data straight from a verified store: the held-out split and its
fingerprint, length-bucketed batches and their assignment to ranks,
collation and a prefetching thread."""
from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from tasks.store.reader import StoreReader


def is_heldout(sample_id: str, fraction: float) -> bool:
    """Held-out by a hash of the sample id: stable across runs, resumes and
    store growth (a sample never moves between the splits)."""
    h = int.from_bytes(hashlib.sha256(f"heldout:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split(sample_ids: Sequence[str], fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The training and held-out samples (indices into `sample_ids`), each in
    sample-id order. Not in store order: that is the order shards were
    committed in, which depends on the nodes, the batch size, retries and
    reruns, and everything downstream follows this order (each epoch's
    batches, the draft vocabulary's sample, the held-out samples evaluated),
    so the same samples train to the same weights however they were
    captured, and a stream run can plan its batches before capture."""
    held = np.array([is_heldout(s, fraction) for s in sample_ids], dtype=bool)
    if len(sample_ids) >= 2 and (held.all() or not held.any()):
        # Tiny stores: keep at least one sample on each side.
        held[:] = False
        held[int(np.argmax([hashlib.sha256(s.encode()).digest() for s in sample_ids]))] = True
    order = np.argsort(np.asarray(sample_ids), kind="stable")
    return order[~held[order]], order[held[order]]


def split_fingerprint(reader: StoreReader, train_idx: np.ndarray, held_idx: np.ndarray) -> dict:
    """What a checkpoint's batch position means depends on: the training
    split's sample ids and token counts in split() order (each epoch's batches
    are cut from them), and the held-out split's (the history's metrics are
    over it). Per split: samples, tokens and a sha256 of (id, tokens) in order."""
    out = {}
    for name, idx in (("train", train_idx), ("heldout", held_idx)):
        h = hashlib.sha256()
        for i in idx:
            h.update(f"{reader.sample_ids[i]}\t{int(reader.num_tokens[i])}\n".encode())
        out[name] = {"samples": len(idx), "tokens": int(reader.num_tokens[idx].sum()), "sha256": h.hexdigest()}
    return out


def describe_split_change(then: dict, now: dict) -> str:
    """Two split fingerprints' differences, in words."""
    changes = []
    for name, what in (("train", "training split"), ("heldout", "held-out split")):
        a, b = then[name], now[name]
        if a == b:
            continue
        if (a["samples"], a["tokens"]) == (b["samples"], b["tokens"]):
            changes.append(f"{what}: {a['samples']} samples ({a['tokens']:,} tokens) then and now, but other "
                           f"samples or another order")
        else:
            changes.append(f"{what}: {a['samples']} samples ({a['tokens']:,} tokens) then, {b['samples']} "
                           f"({b['tokens']:,} tokens) now")
    return "; ".join(changes)


def plan_batches(lengths: np.ndarray, indices: np.ndarray, tokens_per_batch: int,
                 seed: int | None, epoch: int = 0) -> list[list[int]]:
    """Length-bucketed batches cut at a padded-token budget. With a seed the
    order is shuffled deterministically in (seed, epoch), so a resumed run
    replays the same order: shuffle, sort within windows of a few thousand
    samples by length (little padding), cut, shuffle the batches. Without a
    seed (evaluation): sorted by length, no shuffle."""
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    order = rng.permutation(indices) if rng is not None else np.asarray(indices)
    window = 4096 if rng is not None else max(1, len(order))
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        current: list[int] = []
        for i in sorted(order[w:w + window], key=lambda i: lengths[i]):
            if current and lengths[i] * (len(current) + 1) > tokens_per_batch:
                batches.append(current)
                current = []
            current.append(int(i))
        if current:
            batches.append(current)
    return [batches[i] for i in rng.permutation(len(batches))] if rng is not None else batches


def assign_batches(n: int, start: int, rank: int, world: int,
                   accumulate: int = 1) -> list[tuple[int, list[tuple[int, float]]]]:
    """This rank's part of an epoch's batches start..n-1 (indices into the
    epoch's order), per optimizer step: (first batch of the step, this
    rank's `accumulate` batches, each with its loss weight).

    Each step takes the next world x accumulate batches of the order, rank r
    the r-th of every `world` of them, so the batches done after any step
    are a prefix of the order whatever the world size: a checkpoint records
    its length, and a resume under another world size (or accumulation)
    goes on at the next batch. Where fewer are left (m), the slots past
    them run the step's first batch again at weight 0 (DDP and FSDP need
    every rank's backward, and every rank the same number) and the m others
    weigh world/m: the gradient is averaged over the ranks and summed over
    a rank's batches, so the step's gradient is the mean over its m
    batches, as on one device taking the m together."""
    per_step = world * accumulate
    steps = []
    for first in range(start, n, per_step):
        m = min(per_step, n - first)
        mine = []
        for i in range(accumulate):
            slot = i * world + rank
            mine.append((first + slot, world / m) if slot < m else (first, 0.0))
        steps.append((first, mine))
    return steps


def collate(reader: StoreReader, indices: list[int], layers: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors read straight from the shards (only these samples'
    slices are touched); hidden states stay bf16 until they reach the device.
    `layers`: positions in the store's layer axis of the aux states the
    drafter reads (default all)."""
    items = [reader[i] for i in indices]
    if layers is not None:
        items = [{**it, "aux_hidden_states": it["aux_hidden_states"][:, list(layers)]} for it in items]
    lengths = [len(it["input_ids"]) for it in items]
    b, n = len(items), max(lengths)
    h = items[0]["final_hidden_state"].shape[-1]
    out = {
        "input_ids": torch.zeros(b, n, dtype=torch.long),
        "loss_mask": torch.zeros(b, n, dtype=torch.bool),
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "aux": torch.zeros(b, n, items[0]["aux_hidden_states"].shape[1] * h, dtype=items[0]["aux_hidden_states"].dtype),
        "final": torch.zeros(b, n, h, dtype=items[0]["final_hidden_state"].dtype),
    }
    for r, (it, m) in enumerate(zip(items, lengths)):
        out["input_ids"][r, :m] = it["input_ids"].long()
        out["loss_mask"][r, :m] = it["loss_mask"].bool()
        out["aux"][r, :m] = it["aux_hidden_states"].reshape(m, -1)
        out["final"][r, :m] = it["final_hidden_state"]
    return out


def prefetch(make: Callable[[list[int]], dict], batches: Iterable[list[int]], depth: int = 4) -> Iterator[dict]:
    """Collate the next batches in a thread while the current one trains."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def work():
        try:
            for b in batches:
                q.put(make(b))
        except BaseException as e:  # surfaced in the consumer
            q.put(e)
        q.put(done)

    threading.Thread(target=work, daemon=True, name="eagle3-loader").start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def heldout_prompts(store: Path, heldout_fraction: float, count: int) -> list[list[int]]:
    """Prompts of held-out samples (every token before the first loss-masked
    one: the conversation up to the assistant's answer), for serving checks
    on data the drafter never trained on."""
    reader = StoreReader(Path(store))
    ids = reader.sample_ids
    # By the hash alone, in split() order: a spooled stream run's store
    # holds only held-out samples, which split() would take for a tiny store
    # and hold out one of. A store with none by the hash is a tiny one.
    held = [i for i in np.argsort(np.asarray(ids), kind="stable") if is_heldout(ids[i], heldout_fraction)]
    held = held or list(split(ids, heldout_fraction)[1])
    prompts = []
    for i in held:
        s = reader[int(i)]
        mask = s["loss_mask"].bool()
        if mask.any():
            first = int(mask.nonzero()[0])
            if first > 0:
                prompts.append(s["input_ids"][:first].tolist())
        if len(prompts) == count:
            break
    return prompts
