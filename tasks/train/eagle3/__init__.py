"""The EAGLE-3 drafter family: the one-layer drafter (model.py) with its
GQA and MLA attention layouts (gqa.py, mla.py), unrolled step by step in
training (ttt.py), and its side of the training run (training.py)."""
