"""The speculators export read by speculators itself: a drafter exported in
SGLang's layout, written again in the speculators format
(tasks/train/eagle3/speculators.py), loaded with speculators 0.9.0's own
Eagle3DraftModel in its own environment, and its first draft step's
logits compared with ours on the same inputs (the target's aux states, the
tokens, the positions).

    .venv/bin/python bench/speculators_format.py [--drafter runs/demo/train/drafter --target smollm2-135m-instruct]

Without --drafter: an untrained drafter of the tiny test Llama (seeded).
The environment is built once in the cache (`speculators-0.9.0/`): a
virtual environment that sees this project's packages (a .pth file) and
pip-installs speculators with what it pins beyond them; its torch is ours
when ours meets its pin (torch<=2.14.1). The verifier is pointed at the
local target for the load (a published folder names its hub id, which
speculators would download).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tasks.paths import cache_root  # noqa: E402
from tasks.target.models import resolve_model  # noqa: E402
from tasks.train.eagle3.export import load_exported  # noqa: E402
from tasks.train.eagle3.speculators import SPECULATORS_VERSION, export_speculators  # noqa: E402

# Run in speculators' environment: its class loads the folder; the logits
# of the first TTT step are lm_head's output, caught by a hook.
CHILD = r"""
import sys, torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
folder, inputs, out = sys.argv[1:4]
config = Eagle3SpeculatorConfig.from_pretrained(folder)
config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a compiler here
model = Eagle3DraftModel.from_pretrained(folder, config=config, torch_dtype=torch.float32).eval()
x = torch.load(inputs)
caught = []
model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach()))
with torch.no_grad():
    model(hidden_states=x["aux"], input_ids=x["ids"], document_ids=torch.zeros_like(x["ids"]),
          position_ids=x["pos"], ttt_steps=1)
torch.save({"logits": caught[0], "d2t": model.d2t, "class": type(model).__name__}, out)
"""


def speculators_env() -> Path:
    """The environment's python, built on first use."""
    env = cache_root() / f"speculators-{SPECULATORS_VERSION}"
    python = env / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import speculators"], capture_output=True).returncode == 0:
        return python
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", env], check=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "eagle3-project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", f"speculators=={SPECULATORS_VERSION}"], check=True)
    return python


def _tiny_drafter(where: Path, variant: str, tiny: str) -> tuple[Path, Path]:
    """An untrained drafter of the tiny Llama, its norms' weights made
    unlike one another (built as ones, a norm read under another name
    would go unseen)."""
    import numpy as np

    from tasks.target.architectures import architecture_of, read_config
    from tasks.target.layers import AuxLayers
    from tasks.train.eagle3.export import export_drafter
    from tasks.train.eagle3.model import build_drafter
    from tasks.train.vocab import DraftVocab
    from tests.tiny_models import ensure_model

    target = ensure_model(tiny)
    config = read_config(target)
    counts = np.random.default_rng(0).integers(0, 1000, config["vocab_size"])  # a scattered draft vocabulary
    model = build_drafter(target, DraftVocab.from_counts(counts, 512), seed=3, variant=variant)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.5 * torch.rand(p.shape, generator=g))
    layers = AuxLayers.for_model(config["num_hidden_layers"], None)
    return export_drafter(model, layers, where / "drafter", architecture=architecture_of(config)), target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", help="an SGLang-layout EAGLE-3 export (default: an untrained tiny one)")
    p.add_argument("--target", help="its target (a folder, or the demo model's name)")
    p.add_argument("--variant", default="eagle3", help="the untrained drafter's: eagle3 or eagle3.1")
    p.add_argument("--tiny", default="tiny-llama", help="the untrained drafter's target among the tests' tiny models")
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    if args.drafter and not args.target:
        p.error("--drafter needs --target, the checkpoint it was trained for")
    python = speculators_env()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.drafter:
            drafter, target = Path(args.drafter), resolve_model(args.target)
        else:
            drafter, target = _tiny_drafter(tmp, args.variant, args.tiny)
        folder = export_speculators(drafter, tmp / "speculators", target=target, verifier=str(target), drafts=3)
        ours = load_exported(drafter, target).float().eval()
        g = torch.Generator().manual_seed(0)
        n, h, num_aux = args.tokens, ours.cfg.hidden_size, ours.cfg.num_aux
        x = {"aux": torch.randn(1, n, num_aux * h, generator=g) * 2,
             "ids": torch.randint(0, ours.cfg.vocab_size, (1, n), generator=g),
             "pos": torch.arange(n)[None]}
        with torch.no_grad():
            out = ours.step(x["ids"], ours.project(x["aux"]), x["pos"], [], [], torch.ones(1, n, dtype=torch.bool))
            mine = ours.readout(out)[0]
        torch.save(x, tmp / "inputs.pt")
        subprocess.run([python, "-c", CHILD, folder, tmp / "inputs.pt", tmp / "theirs.pt"], check=True)
        theirs = torch.load(tmp / "theirs.pt")
        diff = (theirs["logits"] - mine).abs().max().item()
        scale = mine.abs().max().item()
        same_top = (theirs["logits"].argmax(-1) == mine.argmax(-1)).float().mean().item()
        print(f"speculators {SPECULATORS_VERSION} {theirs['class']} loaded {folder.name} of {drafter} "
              f"(target {target.name}): first draft step, {n} positions x {mine.shape[-1]} draft ids; "
              f"max |logit diff| {diff:.3g} (logits up to {scale:.3g}, ratio {diff / scale:.2e}); same argmax at "
              f"{same_top:.0%} of positions; d2t equal {torch.equal(theirs['d2t'], ours.d2t)}")
        if not (diff <= 1e-3 * max(scale, 1.0) and torch.equal(theirs["d2t"], ours.d2t)):
            sys.exit("the speculators export does not compute our drafter's first step")


if __name__ == "__main__":
    main()
