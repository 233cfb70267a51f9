"""Launch, reports, Optuna search."""
