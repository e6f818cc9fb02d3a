"""Datasets in: formats, chat templates, loss masks, and answers regenerated
by the target itself."""
