"""Explicit mesh sharding: the mesh and ONE table of logical-to-mesh axis rules (rules.py),
and the multi-host runtime (distributed.py). Weights carry logical axis names from their
declarations (dsjax/params.py); this package maps them onto a mesh. The expert-parallel
token dispatch is MoE math and lives with the MoE layer (dsjax/layers/moe.py)."""
