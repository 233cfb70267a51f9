"""simulate and scaling."""
