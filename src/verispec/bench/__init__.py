"""Benchmarks a user runs through the CLI (`verispec bench matrix`): clients of a server
over HTTP, never of the engine inside it. The scripts under bench/ are the developers'."""
