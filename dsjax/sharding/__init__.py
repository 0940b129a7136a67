"""Explicit mesh sharding: the mesh, ONE table of logical-to-mesh axis rules, and the
expert-parallel token dispatch. Weights carry logical axis names from their declarations
(dsjax/params.py); this package maps them onto a mesh."""
