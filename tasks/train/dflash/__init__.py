"""The DFlash drafter family (block diffusion, SGLang's DFlashDraftModel):
the model (model.py), the target layers it reads and its mask token
(target.py), its export (export.py), and its side of the training run
(training.py)."""
