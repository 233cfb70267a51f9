"""What a run is: the config schemas (dataclasses registered in Hydra's ConfigStore by jobs.compose; YAML under
conf/ holds the values), `_target_` plug-ins resolved and checked before any compute, and sizes as people write
them. Imports nothing of ours but the errors."""
