"""Regenerate a dataset's answers with the target itself.

A drafter is scored on guessing the target's own next token; it learns that
best from text the target wrote. This keeps every conversation up to its
last user turn and asks the target (a plain SGLang server) for the answer,
greedily by default, as the serving check and most deployments decode.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import httpx

from tasks.data.config import RegenerateConfig
from tasks.data.dataset import Rejected, read_rows, to_messages
from tasks.sglang_api import client_options

logger = logging.getLogger("eagle3.regeneration")

GREEDY = {"temperature": 0.0}


def prompt_messages(row: dict) -> list[dict]:
    """The conversation up to and including its last user turn."""
    messages = to_messages(row)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("no user turn to answer")
    return messages[:last_user + 1]


def fingerprint(source: Path, model_path: Path, sampling: dict, max_new_tokens: int) -> str:
    """What a regenerated file was made from: a rerun reuses it only if equal."""
    h = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    config = (Path(model_path) / "config.json").read_bytes()
    h.update(hashlib.sha256(config).digest())
    h.update(json.dumps({"sampling": sampling, "max_new_tokens": max_new_tokens}, sort_keys=True).encode())
    return h.hexdigest()[:24]


async def _answer_all(url: str, prompts: list[list[int]], sampling: dict, max_new_tokens: int,
                      concurrency: int, api_key: str | None) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    done = [0]
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=3600, **client_options(api_key)) as client:
        async def one(i, ids):
            params = {**sampling, "max_new_tokens": max_new_tokens}
            if sampling.get("temperature", 1.0) > 0:
                params["sampling_seed"] = i  # reproducible sampled answers
            async with limit:
                r = await client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params})
                r.raise_for_status()
                done[0] += 1
                if done[0] % 50 == 0 or done[0] == len(prompts):
                    logger.info("regenerated %d/%d answers (%.0f s)", done[0], len(prompts),
                                time.monotonic() - started)
                return r.json()
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def regenerate(url: str, source: Path, out_path: Path, tokenizer, *, api_key: str | None = None,
               sampling: dict = GREEDY, max_new_tokens: int = RegenerateConfig.model_fields["max_new_tokens"].default,
               concurrency: int = 16) -> dict:
    """Write `out_path` (JSONL): each usable row of `source` with the target's
    answer to its last user turn, as `messages` (to read) and as the exact
    token ids with the answer loss-masked (`input_ids`, `loss_mask`: what
    extraction uses). Rows that cannot be used
    are left out and counted; the file is written whole or not at all. Every
    request carries the server's `api_key`."""
    prompts, kept, skipped = [], [], 0
    for _, row in read_rows(Path(source)):
        try:
            if isinstance(row, Rejected):
                raise ValueError(row.reason)
            messages = prompt_messages(row)
        except ValueError:
            skipped += 1
            continue
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        prompts.append(list(ids["input_ids"]))
        kept.append(({"id": row["id"]} if "id" in row else {}, messages, prompts[-1]))
    if not prompts:
        raise ValueError(f"{source}: no row has a user turn to answer")
    logger.info("asking the target for %d answers (%d rows skipped), up to %d tokens each", len(prompts), skipped,
                max_new_tokens)
    started = time.monotonic()
    replies = asyncio.run(_answer_all(url, prompts, sampling, max_new_tokens, concurrency, api_key))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        for (extra, messages, prompt), reply in zip(kept, replies):
            answer = {"role": "assistant", "content": reply["text"].strip()}
            # The tokens themselves, not only the text: decoding and
            # re-tokenising need not give back the ids the target produced.
            ids = prompt + list(reply["output_ids"])
            mask = [0] * len(prompt) + [1] * len(reply["output_ids"])
            f.write(json.dumps({**extra, "messages": messages + [answer], "input_ids": ids, "loss_mask": mask},
                               ensure_ascii=False) + "\n")
    os.replace(tmp, out_path)
    tokens = sum(r["meta_info"]["completion_tokens"] for r in replies)
    seconds = time.monotonic() - started
    logger.info("regenerated %d answers, %d tokens in %.0f s (%.0f tok/s) -> %s", len(replies), tokens, seconds,
                tokens / max(seconds, 1e-9), out_path)
    return {"rows": len(replies), "skipped": skipped, "tokens": tokens, "seconds": seconds, "path": str(out_path)}
