"""A cheap fingerprint of a checkpoint's weights, so a store knows which
weights produced it, not only which config (a fine-tune keeps its base
model's config.json byte for byte).

Per weight file, in name order: its name, its size, its safetensors header
(every tensor's name, dtype, shape and offsets) and SAMPLES blocks of
BLOCK bytes spread evenly over the data. A changed tensor is caught when a
sample falls in it; any change of layout, size or header always is. Reading
a 1 TB checkpoint this way costs SAMPLES x BLOCK per file (64 MiB for
Kimi-K2.5's 64 files), not the terabyte a full hash would.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLES, BLOCK = 16, 64 * 1024


def weight_files(model_path: Path) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        files = sorted(Path(model_path).glob("*.bin")) + sorted(Path(model_path).glob("*.pt"))
    return files


def weights_fingerprint(model_path: Path) -> str:
    digest = hashlib.sha256()
    files = weight_files(model_path)
    if not files:
        raise FileNotFoundError(f"{model_path}: no weight files (*.safetensors, *.bin, *.pt)")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            start = 0
            if path.suffix == ".safetensors" and size >= 8:
                (header_len,) = struct.unpack("<Q", f.read(8))
                digest.update(f.read(min(header_len, size - 8)))
                start = 8 + header_len
            span = max(size - start, 0)
            for k in range(SAMPLES):
                f.seek(start + span * k // SAMPLES)
                digest.update(f.read(BLOCK))
    return digest.hexdigest()
