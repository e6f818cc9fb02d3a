"""Regenerate data/demo_conversations.jsonl: the bundled prompts answered by
the demo target itself (SmolLM2-135M-Instruct) on SGLang.

Drafters learn best from the target's own outputs, so the demo data is the
target's answers, generated once and committed. Rerun only when the prompts
change:  .venv/bin/python scripts/make_demo_dataset.py
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from transformers import AutoTokenizer

from tasks.models import SMOLLM2, ensure_model
from tasks.paths import DATA_DIR, cache_root
from tasks.server import ServerConfig, launch_server

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 320, "repetition_penalty": 1.1}


async def answer_all(url: str, prompts: list[str], concurrency: int = 64) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=3600) as client:
        async def one(i, text):
            async with limit:
                r = await client.post(f"{url}/generate", json={
                    "text": text, "sampling_params": {**SAMPLING, "sampling_seed": i}})
                r.raise_for_status()
                return r.json()
        return await asyncio.gather(*(one(i, t) for i, t in enumerate(prompts)))


def main() -> None:
    model = ensure_model(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (DATA_DIR / "demo_prompts.jsonl").read_text().splitlines()]
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    cfg = ServerConfig(model_path=str(model), dump_dir=cache_root() / "unused-dumps", capture=False, max_total_tokens=65536)
    t0 = time.time()
    with launch_server(cfg, cache_root() / "logs" / "make-demo-dataset.log") as server:
        outs = asyncio.run(answer_all(server.url, texts))
    out_path = DATA_DIR / "demo_conversations.jsonl"
    with open(out_path, "w") as f:
        for row, out in zip(rows, outs):
            reply = out["text"].strip()
            f.write(json.dumps({"id": row["id"], "messages": row["messages"] + [
                {"role": "assistant", "content": reply}]}, ensure_ascii=False) + "\n")
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(f"{len(rows)} conversations, {tokens} generated tokens in {time.time() - t0:.0f} s -> {out_path}")


if __name__ == "__main__":
    main()
