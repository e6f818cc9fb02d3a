"""Regenerate data/demo_conversations.jsonl: the bundled prompts answered by
the demo target itself (SmolLM2-135M-Instruct) on SGLang.

Drafters learn best from the target's own outputs, so the demo data is the
target's answers, generated once and committed. Rerun only when the prompts
change:  .venv/bin/python scripts/make_demo_dataset.py
"""
from __future__ import annotations

from transformers import AutoTokenizer

from tasks.paths import DATA_DIR, cache_root
from tasks.regeneration.answer_store import AnswerStore
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.stage import regenerate
from tasks.server.config import ServerConfig
from tasks.server.launch import LaunchSpec, launch_server
from tasks.target.models import SMOLLM2, resolve_model

SETTINGS = RegenerateConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.1, max_new_tokens=320, concurrency=64)


def main() -> None:
    model = resolve_model(SMOLLM2)
    spec = LaunchSpec(ServerConfig(model=str(model)))
    answers = cache_root() / "demo-answers"
    with launch_server(spec, cache_root() / "logs" / "make-demo-dataset.log") as server:
        result = regenerate(server.url, DATA_DIR / "demo_prompts.jsonl", answers, AutoTokenizer.from_pretrained(model),
                            model, SETTINGS, api_key=server.api_key)
    AnswerStore(answers).export(DATA_DIR / "demo_conversations.jsonl")
    print(f"{result['rows']} conversations, {result['answer_tokens']} generated tokens in {result['seconds']:.0f} s "
          f"-> {DATA_DIR / 'demo_conversations.jsonl'}")


if __name__ == "__main__":
    main()
