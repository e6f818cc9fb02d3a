"""What the project knows about target models: architectures, aux layer ids,
the models it builds, and an independent forward pass to check captures."""
