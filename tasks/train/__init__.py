"""Drafter training: the drafter and its served forward, draft vocabulary,
TTT, data, the loop with checkpoints, metrics, export, multi-device launch."""
