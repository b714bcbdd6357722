"""Tests of the `specdec` command line (specdec/cli)."""
