"""Running stock SGLang: launch, health, stop, supervision, and what it
needs on a machine without a GPU."""
