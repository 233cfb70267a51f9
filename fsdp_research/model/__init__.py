"""The model: built from its config on the meta device (architecture), its dimensions, its initialisation replayed
shard by shard (initialization, from the recipes, model.recipes, of the writes recorded_init records), pretrained
weights read into the shards (pretrained), aux-loss-free MoE balancing, LoRA (PEFT's adapters), the
document-masking check, and assembly: the model as training runs it (meta -> activation checkpointing -> compile
-> fully_shard -> materialized). Builds only: the checks are train.refusals's."""
