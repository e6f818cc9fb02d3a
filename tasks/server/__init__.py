"""Running stock SGLang: the server section a user gives, launch, health,
stop, supervision, and (cpu/) what it needs on a machine without a GPU."""
