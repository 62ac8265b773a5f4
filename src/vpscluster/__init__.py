"""vpscluster: turn a handful of rented machines into a cluster that trains language models."""

__version__ = "0.1.0"
