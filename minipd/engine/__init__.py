"""Running requests: validation, the generation loop and its metrics."""
