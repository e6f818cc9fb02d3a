"""Drafter training: its settings, the drafter and its served forward, draft
vocabulary, TTT, data, preparation, the loop, evaluation, checkpoints,
distributed set-up, metrics, export, multi-device launch."""
