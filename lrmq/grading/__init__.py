"""Answer grading: extraction, normalisation and math-verify equivalence (no JAX, no lrmq above core)."""
