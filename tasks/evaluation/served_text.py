"""Training's acceptance simulated on the very text SGLang verified, beside
SGLang's own count for the same drafter on it.

A speculative server's greedy output is the plain target's greedy
continuation (the evaluation checks it), so the target's states over prompt
and continuation are what SGLang's draft extends saw. Captured once from a
capture server of the target, in the evaluation's dtype, they let training's
unroll (tasks/train/eagle3/ttt.py) score the drafter on exactly those tokens, two
ways:

- all positions: the exact chained acceptance training reports (the share
  of starting positions whose drafts 1..k all hit), over every position of
  the continuation: training's held-out figure, on served text;
- verify steps: SGLang's walk, replayed. The first chain starts at the
  prompt's last token (the prefill gives the first new token), a verify step
  that accepts L drafts moves the next chain L + 1 tokens on, and the walk
  stops once max_new_tokens are out. Its histogram of accepted drafts per
  step is SGLang's `spec_correct_drafts_histogram` when the drafter computes
  what SGLang's does: the two are compared request by request.

So the distance from training's held-out figure to SGLang's splits into
the text (the dataset's answers against the target's greedy continuation:
held-out against all positions), where chains start (all positions against
the replayed steps: SGLang drafts only where the last verify stopped) and
any difference between training's unroll and SGLang's decode (the replay
against SGLang's count, which should be nothing).

The continuation is generated `num_steps` tokens past max_new_tokens: a last
verify step's drafts are counted even where they run past the output.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from tasks.capture.client import capture_many
from tasks.capture.dump import Capture
from tasks.evaluation.acceptance import per_position
from tasks.evaluation.generate import generate_all
from tasks.target.layers import AuxLayers
from tasks.train.eagle3.export import load_exported
from tasks.train.eagle3.ttt import chain_hits, ttt_forward

# A gap between two shares beyond this many standard errors is reported as
# one: at 3 the chance of calling noise a gap is 0.3% per position.
GAP_SE = 3.0


@dataclass(frozen=True)
class ServedText:
    """A prompt and the target's greedy continuation of it."""
    prompt: list[int]
    continuation: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.continuation


@dataclass(frozen=True)
class Walk:
    """One request's draft chains, scored by the drafter on its served text."""
    histogram: list[int]  # replayed verify steps that accepted k drafts, k = 0..K
    chained: list[int]  # per step k, starting positions whose drafts 0..k all hit
    counted: list[int]  # per step k, starting positions whose drafts 0..k all lie in the output
    target_agrees: int  # positions where the captured state's argmax is the text's next token
    positions: int


def served_texts(url: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, api_key: str | None,
                 concurrency: int, timeout_s: float, tag: str) -> list[ServedText]:
    """The target's greedy continuation of each prompt, EOS ignored as the
    evaluation's requests ignore it."""
    run = asyncio.run(generate_all(url, prompts, api_key=api_key, max_new_tokens=max_new_tokens, ignore_eos=True,
                                   concurrency=concurrency, timeout_s=timeout_s, tag=tag))
    return [ServedText(list(p), list(out)) for p, out in zip(prompts, run.output_ids, strict=True)]


def capture_texts(url: str, dump_dir: Path, texts: Sequence[ServedText], *, api_key: str | None,
                  rid_prefix: str | None, concurrency: int, timeout_s: float) -> list[Capture]:
    """Each text's states from a capture server, keyed by its rid and
    checked against what was sent (tasks/capture/client.py)."""
    got = capture_many(url, dump_dir, [t.ids for t in texts], lambda i, c: c, api_key=api_key,
                       **({"rid_prefix": rid_prefix} if rid_prefix else {}), concurrency=concurrency,
                       timeout_s=timeout_s)
    failed = [(i, e) for i, e in enumerate(got) if isinstance(e, Exception)]
    if failed:
        i, e = failed[0]
        raise RuntimeError(f"capturing the served text of prompt {i} failed ({len(failed)} of {len(texts)} "
                           f"failed): {e}") from e
    return got


def walk(model, full_head: torch.Tensor, capture: Capture, layers: Sequence[int], prompt_len: int,
         max_new_tokens: int, steps: int) -> Walk:
    """The drafter's chains over one served text (`capture`: its prompt and
    continuation, at least max_new_tokens + steps tokens past the prompt),
    reading the aux layers at `layers` (positions in the capture's layer
    axis), scored against the target's lm_head `full_head` (fp32): the
    replayed verify steps and the chained hits over all positions of the
    first max_new_tokens."""
    ids = capture.input_ids.long()
    n = ids.shape[0]
    if n < prompt_len + max_new_tokens + steps:
        raise ValueError(f"a served text of {n} tokens after a {prompt_len}-token prompt is shorter than "
                         f"max_new_tokens {max_new_tokens} + {steps} drafts")
    pos = torch.arange(n)
    batch = {"input_ids": ids[None], "loss_mask": (pos > prompt_len)[None], "lengths": torch.tensor([n]),
             "aux": capture.aux_hidden_states[:, list(layers)].reshape(n, -1)[None].float(),
             "final": capture.final_hidden_state[None].float()}
    with torch.no_grad():
        out = ttt_forward(model, batch, full_head[model.draft_to_target], steps=steps, decay=1.0,
                          full_head=full_head)
    hits, scored, greedy = out.hits[:, 0], out.scored[:, 0], out.target_top[0]
    # Drafts of the first max_new_tokens only: what training would score on this text.
    inside = torch.stack([pos + k + 2 < prompt_len + max_new_tokens for k in range(steps)])
    chained, counted = chain_hits(list(hits & inside), list(scored & inside))
    continuation = slice(prompt_len, prompt_len + max_new_tokens - 1)
    return Walk(replay(hits, scored, prompt_len, max_new_tokens), chained.tolist(), counted.tolist(),
                int((greedy[continuation] == ids[prompt_len + 1:prompt_len + max_new_tokens]).sum()),
                max_new_tokens - 1)


def replay(hits: torch.Tensor, scored: torch.Tensor, prompt_len: int, max_new_tokens: int) -> list[int]:
    """SGLang's verify steps over one request, from the drafter's hits [K, n]
    (step k of the chain starting at t): the first chain starts at the
    prompt's last token, each step that accepts L drafts adds L + 1 tokens
    (the drafts and the target's own) and the next chain starts L + 1 on,
    until max_new_tokens are out. Returns the histogram of accepted drafts
    per step (K + 1 bins)."""
    k_max = hits.shape[0]
    histogram = [0] * (k_max + 1)
    t, made = prompt_len - 1, 1
    while made < max_new_tokens:
        if not bool(scored[:, t].all()):
            raise ValueError(f"the chain starting at token {t} runs past the served text: generate "
                             f"{k_max} tokens past max_new_tokens")
        accepted = 0
        while accepted < k_max and bool(hits[accepted, t]):
            accepted += 1
        histogram[accepted] += 1
        made += accepted + 1
        t += accepted + 1
    return histogram


def clustered_se(hits: Sequence[int], counts: Sequence[int]) -> float:
    """Standard error of sum(hits) / sum(counts) with requests as clusters:
    positions of one request are not independent draws (a hard passage
    misses many drafts), so a binomial error over positions would be too
    small."""
    m, total = len(counts), sum(counts)
    if m < 2 or not total:
        return float("nan")
    p = sum(hits) / total
    return math.sqrt(m / (m - 1) * sum((a - p * n) ** 2 for a, n in zip(hits, counts))) / total


def binomial_se(p: float, n: int) -> float:
    """Standard error of a share over n independent draws (a lower bound for
    positions of a few long texts)."""
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def gap(a: float | None, se_a: float, b: float | None, se_b: float) -> dict | None:
    """a - b, its standard error, and whether it is beyond GAP_SE of them."""
    if a is None or b is None:
        return None
    se = math.hypot(se_a, se_b)
    return {"difference": a - b, "se": se, "beyond_noise": bool(abs(a - b) > GAP_SE * se) if se == se else None}


def load_drafter(path: Path, target: Path):
    """An exported drafter as the simulation runs it (fp32, eval) and the
    aux layers it reads."""
    return load_exported(path, target).float().eval(), AuxLayers(tuple(drafter_layers(path)))


def simulate(drafter, full_head: torch.Tensor, num_steps: int, heldout: dict | None,
             texts: Sequence[ServedText | None], captures: Sequence[Capture | None], served_metas: Sequence[dict],
             max_new_tokens: int) -> dict:
    """A drafter (`load_drafter`'s pair), served with `num_steps` drafts, on
    one prompt set's served texts: per draft position, training's held-out
    chain (`heldout`: its run's last held-out metrics, if known), the chain
    over all positions of the served text, the replayed verify steps and
    SGLang's count (`served_metas`, its greedy requests' meta_info), with the
    gaps between neighbours and the requests where the replay and SGLang
    differ. `full_head` is the target's lm_head. A prompt whose text is None
    (not the text SGLang verified) is left out and named."""
    model, config_layers = drafter
    full_head = full_head.float()
    k_max = num_steps
    walks, served, differ, left_out = [], [], [], []
    for i, (text, capture, meta) in enumerate(zip(texts, captures, served_metas, strict=True)):
        if text is None or capture is None:
            left_out.append(i)
            continue
        try:
            positions = config_layers.positions_in(AuxLayers(tuple(capture.aux_layer_ids)))
        except ValueError:
            raise ValueError(f"the drafter reads aux layers {list(config_layers.sglang_ids)} (SGLang ids), "
                             f"but the served text was captured with layers {list(capture.aux_layer_ids)}: give a "
                             f"capture server that captures them, or let the evaluation launch one") from None
        w = walk(model, full_head, capture, positions, len(text.prompt), max_new_tokens, k_max)
        theirs = list(meta.get("spec_correct_drafts_histogram") or [])
        theirs += [0] * (k_max + 1 - len(theirs))
        walks.append(w)
        served.append(theirs)
        if w.histogram != theirs:
            differ.append(i)
    if not walks:
        return {"requests": 0, "left_out": left_out}
    replayed = [sum(c) for c in zip(*(w.histogram for w in walks))]
    sglang = [sum(c) for c in zip(*served)]
    steps_se = [clustered_se([sum(w.histogram[k:]) for w in walks], [sum(w.histogram) for w in walks])
                for k in range(1, k_max + 1)]
    sglang_se = [clustered_se([sum(h[k:]) for h in served], [sum(h) for h in served]) for k in range(1, k_max + 1)]
    all_pos = [sum(w.chained[k] for w in walks) / max(1, sum(w.counted[k] for w in walks)) for k in range(k_max)]
    all_se = [clustered_se([w.chained[k] for w in walks], [w.counted[k] for w in walks]) for k in range(k_max)]
    held = (heldout or {}).get("chain")
    held_n = (heldout or {}).get("chain_counted")
    held = held[:k_max] if held and len(held) >= k_max else None
    held_se = [binomial_se(p, n) for p, n in zip(held, held_n)] if held and held_n else [float("nan")] * k_max
    steps_pp, sglang_pp = per_position(replayed), per_position(sglang)
    return {
        "requests": len(walks), "left_out": left_out,
        "per_position": {
            "heldout_training": held,
            "served_text_all_positions": all_pos,
            "served_text_verify_steps": steps_pp,
            "sglang": sglang_pp,
        },
        "standard_errors": {"heldout_training": held_se if held else None, "served_text_all_positions": all_se,
                            "served_text_verify_steps": steps_se, "sglang": sglang_se},
        "gaps": {
            "text": [gap(h, hs, a, s) for h, hs, a, s in zip(held or [None] * k_max, held_se, all_pos, all_se)],
            "where_chains_start": [gap(a, s, v, vs) for a, s, v, vs in zip(all_pos, all_se, steps_pp, steps_se)],
        },
        "replayed_histogram": replayed, "sglang_histogram": sglang,
        "replay_equals_sglang": len(walks) - len(differ), "replay_differs": differ,
        "tau_all_positions": sum(all_pos), "accept_length_replayed": 1 + sum(steps_pp),
        "accept_length_sglang": 1 + sum(sglang_pp),
        # The captured states' own greedy token against the served text: 1.0 unless the capture server
        # computes differently from the servers that produced the text.
        "target_agrees": sum(w.target_agrees for w in walks) / max(1, sum(w.positions for w in walks)),
    }


def drafter_layers(path: Path) -> list[int]:
    """The aux layers an exported drafter reads (SGLang's ids)."""
    return json.loads((Path(path) / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
