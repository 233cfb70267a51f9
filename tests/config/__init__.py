"""The config: schemas, composition, and bad input refused in one line."""
