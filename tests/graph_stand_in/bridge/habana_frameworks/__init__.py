"""Test stand-in for Habana's ``habana_frameworks`` package (see ../README.md)."""
