"""Models: the zoo, own models, initialisation by shard, MoE."""
