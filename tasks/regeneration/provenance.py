"""What a set of answers is made from, written once beside them and checked
on every open (answer_store.py) and by every node's child run: a resume
under anything different would mix two targets' or two templates' answers
in one dataset, unseen.

The target is named by what decides its answers: its config, its weights
(each file's name, size, safetensors header and the first bytes of every
tensor: a changed checkpoint is found without reading 2 TB), its tokenizer
and generation files and the chat template the run renders with, and the
server flags that change numerics (dtype, quantization, the KV cache's
dtype, tensor parallelism, deterministic inference, ...)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tasks.regeneration.config import RegenerateConfig
from tasks.store.shards import file_sha256

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# Beside the tokenizer's own files: generation_config.json, whose
# eos_token_id SGLang adds to a request's stop tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "tiktoken.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
# Flags that change what a server answers for the same request.
ANSWER_FLAGS = ("--quantization", "--kv-cache-dtype", "--enable-deterministic-inference", "--attention-backend",
                "--sampling-backend", "--preferred-sampling-params", "--context-length", "--json-model-override-args",
                "--revision", "--enable-fp32-lm-head", "--moe-runner-backend", "--ep-size")
TENSOR_SAMPLE = 64  # bytes at each end of each tensor: a fine-tune or a merged LoRA changes all of a tensor's
WINDOW, WINDOWS = 1 << 16, 32  # other formats: evenly spread windows, and the file's ends


def weights_fingerprint(model_path: Path) -> str:
    """A hash over every weight file's name and size and, for safetensors,
    its header and the first bytes of every tensor (a checkpoint whose
    weights differ in any tensor differs here, read in seconds, not the
    hours 2 TB take); other formats: strided windows."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(model_path).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        # Unbuffered reads at their offsets: a buffered file would fetch a
        # whole file-system block (MiBs on Lustre) for each 64 bytes.
        fd = os.open(f, os.O_RDONLY)
        try:
            head = os.pread(fd, 8, 0)
            if f.suffix == ".safetensors" and len(head) == 8:
                header = os.pread(fd, int.from_bytes(head, "little"), 8)
                h.update(header)
                base = 8 + len(header)
                tensors = json.loads(header)
                spans = {k: v["data_offsets"] for k, v in tensors.items() if k != "__metadata__"}
                # Read in file order, hashed in name order; each tensor's first and last bytes.
                read = {name: os.pread(fd, TENSOR_SAMPLE, base + start) +
                        os.pread(fd, TENSOR_SAMPLE, base + max(start, end - TENSOR_SAMPLE))
                        for name, (start, end) in sorted(spans.items(), key=lambda kv: kv[1][0])}
                for name in sorted(read):
                    h.update(read[name])
            else:
                for k in range(WINDOWS + 1):
                    h.update(os.pread(fd, WINDOW, max(0, min(size - WINDOW, k * (size // WINDOWS)))))
        finally:
            os.close(fd)
    return h.hexdigest()


def tokenizer_fingerprint(model_path: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(model_path) / name
        if f.is_file():
            h.update(f"{name}:{file_sha256(f)}".encode())
    return h.hexdigest()


def answer_flags(server) -> dict:
    """The server settings that change its answers (a ServerConfig)."""
    args, given = list(server.extra_args), {}
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in ANSWER_FLAGS:
            given[flag] = value or (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else True)
    return {"dtype": server.dtype, "tp_size": server.tp_size, **given}


SERVED_KEYS = ("dtype", "tp_size", *(f[2:].replace("-", "_") for f in ANSWER_FLAGS))


def served_flags(url: str, api_key: str | None = None) -> dict:
    """The settings that change answers of the server at `url` as it runs,
    from its /server_info (a node's own server, or one attached by URL, is
    not described by the run's server section): `settings`, the values SGLang
    resolved, and `given`, those its command line set (a value SGLang chose
    itself, an attention backend per GPU type, may differ between nodes that
    were started alike)."""
    import shlex

    from tasks.sglang_api import server_json

    info = server_json(url, "/server_info", "its settings", api_key=api_key)
    given = set()
    # Only flag names are read from the command line: it also holds the server's API key.
    for word in shlex.split(info.get("launch_command") or ""):
        name = word.partition("=")[0][2:].replace("-", "_") if word.startswith("--") else ""
        name = "tp_size" if name == "tp" else name
        # argparse takes a flag's unique prefix (--kv-cache for --kv-cache-dtype).
        matches = [k for k in SERVED_KEYS if k == name] or [k for k in SERVED_KEYS if name and k.startswith(name)]
        if len(matches) == 1:
            given.add(matches[0])
    return {"settings": {k: info.get(k) for k in SERVED_KEYS}, "given": sorted(given)}


def provenance(source: Path | None, model_path: Path, cfg: RegenerateConfig, tokenizer=None, server=None) -> dict:
    """The record kept with the answers (`source` None: a node's child,
    which does not hash its parent's dataset again)."""
    record = {"target": str(model_path), "target_config_sha256": file_sha256(Path(model_path) / "config.json"),
              "weights": weights_fingerprint(model_path), "tokenizer_sha256": tokenizer_fingerprint(model_path),
              "settings": cfg.identity()}
    if source is not None:
        record = {"source": str(Path(source).resolve()), "source_sha256": file_sha256(source), **record}
    if tokenizer is not None:
        record["chat_template_sha256"] = hashlib.sha256(
            json.dumps(tokenizer.chat_template, sort_keys=True).encode()).hexdigest()
    if server is not None:
        record["server"] = answer_flags(server)
    return record


def sampled_without_determinism(cfg: RegenerateConfig, server) -> str | None:
    """What a run's summary says of sampled answers its server will not
    draw again from their seeds (SGLang applies a request's seed only with
    --enable-deterministic-inference)."""
    if cfg.temperature <= 0 or "--enable-deterministic-inference" in answer_flags(server):
        return None
    return ("answers were sampled (temperature > 0) on a server without --enable-deterministic-inference: SGLang "
            "ignores their seeds, so a rerun or a resumed run draws other answers")
