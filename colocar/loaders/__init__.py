"""Distributed input pipelines on the sidecars (grain), feeding global jax.Arrays (see issue 3)."""
