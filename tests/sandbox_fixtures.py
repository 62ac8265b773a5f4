"""Fixtures that bring an emulated cluster (vpscluster sandbox) up and down around tests."""
