"""Shared helpers for the distributed tests and benchmarks (spawned gloo meshes, cached references)."""
