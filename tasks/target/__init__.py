"""What the project knows about target models: architectures, aux layer ids,
the demo model, and an independent forward pass to check captures."""
