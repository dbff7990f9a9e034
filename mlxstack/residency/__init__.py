"""Models on demand (MODELS_ON_DEMAND): the router on the MLX port that starts, keeps and unloads
one MLX server process per model (router.py), and the pure rule of which models stay (policy.py)."""
