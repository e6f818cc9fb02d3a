"""What tests/sglang_draft_probe.py recorded of a drafter SGLang served,
read back for tests/test_drafter_in_sglang.py: the served drafters' records
(an EAGLE-3 drafter's, the side-by-side evaluation's), the probe's hook and
its files in call order, where a request's draft extend and DFlash blocks
are among them, and the greedy tokens of PROMPT from a server and from HF."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from safetensors import safe_open

from tasks.sglang_api import auth_headers
from tasks.target.reference import load_reference_model

PROMPT = list(range(40, 90))
# The DFlash drafter's block: the bonus token and three drafts a verify step.
DFLASH_BLOCK = 4


@dataclass
class Served:
    target_path: Path
    drafter_dir: Path
    variant: str
    attention: str
    output_ids: list[int]
    forwards: list[dict]  # the probe's files in call order, each with its "kind"
    params: dict[str, torch.Tensor]  # the drafter's parameters as SGLang loaded them


def _read(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {"kind": f.metadata()["kind"], **{k: f.get_tensor(k) for k in f.keys()}}


def eagle_probe(out_dir: Path) -> dict:
    return {"name": "draft_probe", "target_modules": ["model"], "hook_factory": "tests.sglang_draft_probe:make_probe",
            "config": {"out_dir": str(out_dir)}}


def greedy(url: str, api_key: str | None) -> list[int]:
    """PROMPT's first greedy tokens from the server at `url`."""
    return httpx.post(f"{url}/generate", timeout=300, headers=auth_headers(api_key), json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()["output_ids"]


def _probed(probe: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The probe's forwards in call order, and the drafter's parameters as SGLang loaded them."""
    with safe_open(str(probe / "params.safetensors"), framework="pt") as f:
        params = {k: f.get_tensor(k) for k in f.keys()}
    return [_read(p) for p in sorted(probe.glob("forward-*.safetensors"))], params


def _prefill_extend(served: Served) -> int:
    """Index of the draft extend after PROMPT's first prefill: token t+1's
    embedding goes with token t's aux state, the last position with the
    token the target just chose. (Other extends are SGLang's warm-up
    request's, follow a verify, or are of PROMPT sent again: the
    evaluation's sweep.)"""
    want = PROMPT[1:] + [served.output_ids[0]]
    found = [i for i, f in enumerate(served.forwards) if f["kind"] == "extend" and f["input_ids"].tolist() == want]
    assert found, [(f["kind"], f["input_ids"][:6].tolist()) for f in served.forwards]
    return found[0]


def hf_greedy(target_path: Path, n: int) -> list[int]:
    """HF's greedy tokens after PROMPT, each checked to lead its runner-up by
    far more than SGLang's target differs from HF's (TARGET_ATOL on states):
    a near tie would make a comparison a coin toss, and is reported as such."""
    reference = load_reference_model(str(target_path), torch.float32)
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(n):
            top = torch.topk(reference(input_ids=torch.tensor([ids])).logits[0, -1], 2)
            assert top.values[0] - top.values[1] > 1e-2, f"near tie after {len(ids)} tokens: change PROMPT"
            ids.append(int(top.indices[0]))
    return ids[len(PROMPT):]


@dataclass
class SideBySide:
    report: dict
    raw: list[dict]  # SGLang's per-request counts
    eagle_dir: Path
    dflash_dir: Path
    forwards: list[dict]  # the DFlash probe's files in call order
    params: dict[str, torch.Tensor]  # the DFlash drafter's parameters as SGLang loaded them
    dflash_history: list[dict]  # its training's metrics, the last epoch's served in SGLang (serve_every)
    eagle: Served  # the EAGLE-3 drafter as the probe saw it served (the `served` grid's Llama case)


def _first_request(side_by_side: SideBySide) -> tuple[torch.Tensor, dict, list[dict]]:
    """PROMPT's request, from the DFlash probe: the target states of every
    token it committed, in position order, its prompt's context call, and
    its draft blocks. After prefill the context is the prompt's states;
    after each verify, the block's block_size states, of which the tokens
    committed (the accepted drafts and the token before them) are the
    first next_start - start: the next block starts where they end. The
    next request starts a context of its own."""
    forwards = side_by_side.forwards
    first = next(i for i, f in enumerate(forwards) if f["kind"] == "context"
                 and f["target_hidden"].shape[0] == len(PROMPT))
    features, committed, blocks, verified = [forwards[first]["target_hidden"]], len(PROMPT), [], None
    for f in forwards[first + 1:]:
        if f["kind"] == "context":
            if f["target_hidden"].shape[0] != DFLASH_BLOCK:  # a prompt: the next request
                break
            verified = f["target_hidden"]
            continue
        start = f["positions"][0].item()
        if blocks:
            kept = start - blocks[-1]["positions"][0].item()
            if verified is None or not 1 <= kept <= DFLASH_BLOCK:
                break
            features.append(verified[:kept])
            committed, verified = committed + kept, None
        if start != committed:
            break
        blocks.append(f)
    assert len(blocks) >= 3, [(f["kind"], f["target_hidden"].shape[0] if f["kind"] == "context" else
                               f["positions"][0].item()) for f in forwards[first:first + 12]]
    return torch.cat(features), forwards[first], blocks
